"""Errors the gateway answers in OpenAI's format: ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status an OpenAI client maps to its exception classes.

The statuses are chosen so that a harness stops rather than retrying a call that can never succeed: 401 (unknown
key: ``AuthenticationError``), 403 (a closed attempt, or one over its turn or token limits:
``PermissionDeniedError``), 404 (another model: ``NotFoundError``), 400 ``context_length_exceeded`` (the prompt
leaves no room to generate; litellm raises ``ContextWindowExceededError``), 400 for a request the gateway cannot
serve as asked, 500 when the rollout engine failed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["GatewayError"]

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error"}


class GatewayError(Exception):
    """A call the gateway refuses; :meth:`body` is its OpenAI-format JSON.

    Args:
        status: The HTTP status.
        code: OpenAI's machine-readable ``code`` (e.g. ``invalid_api_key``, ``context_length_exceeded``).
        message: One line naming the problem and the fix.
        param: The request field at fault, if one is.
    """

    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def body(self) -> dict[str, Any]:
        kind = _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
