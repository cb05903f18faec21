"""Every HTTP route of a vLLM OpenAI-compatible server that tslightning calls, behind one error policy.

:class:`ServerClient` wraps one server's base URL and a ``requests`` session (one per thread that uses it). Its
policy, the same for every route:

- a ``200`` answer is the route's JSON (``{}`` when the body is empty or not JSON);
- any other status raises :class:`ServerError`, naming the method, the URL, the status and the start of the body;
- a connection that fails (refused, reset, timed out) raises ``requests``' own exception, unchanged: the caller
  decides whether a server that does not answer is a problem line, a lost replica or a failed publication.

The weight-sync routes (``/pause``, ``/resume``, ``/weight_info``, ``/update_weight_version``, ``/collective_rpc``,
``/server_info``, ``/is_paused``) exist only on servers started with ``VLLM_SERVER_DEV_MODE=1``; the token-in route
``/inference/v1/generate`` only with ``--enable-scale-out``. Imports ``requests`` (vLLM's dependency), never vLLM.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["ServerClient", "ServerError", "ThreadClients"]


class ServerError(RuntimeError):
    """A server answered a route with a status other than 200.

    Attributes:
        status: The HTTP status.
        text: The answer's body (its start is in the message).
    """

    def __init__(self, method: str, url: str, status: int, text: str) -> None:
        super().__init__(f"{method} {url} answered {status}: {text[:300]}")
        self.status, self.text = status, text


class ServerClient:
    """One vLLM server's routes (see the module docstring for the error policy).

    Args:
        url: The server's base URL (``http://host:port``; a trailing ``/`` is dropped).
        timeout_s: Seconds each call may take.
    """

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        import requests

        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.session = requests.Session()

    def get(self, route: str, **params: Any) -> Any:
        """``GET route`` with query ``params``: its JSON."""
        return self._answer("GET", self.session.get(self.url + route, params=params or None, timeout=self.timeout_s))

    def post(self, route: str, body: Any = None, timeout_s: float | None = None, **params: Any) -> Any:
        """``POST route`` with JSON ``body`` and query ``params``: its JSON (``{}`` when empty)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        answer = self.session.post(self.url + route, json=body, params=params or None, timeout=timeout)
        return self._answer("POST", answer)

    # Routes every vLLM server has.
    def health(self) -> bool:
        """Whether ``GET /health`` answers 200 (a server that does not answer at all: ``False``)."""
        import requests

        try:
            return self.session.get(self.url + "/health", timeout=self.timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def models(self) -> list[dict[str, Any]]:
        """``GET /v1/models``'s served models (``[]``: none)."""
        return list(self.get("/v1/models").get("data") or [])

    def tokenize(self, text: str) -> list[int]:
        """The server tokenizer's ids for ``text`` (no special tokens)."""
        return list(self.post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])

    def generate(self, body: dict[str, Any], resend: bool = False) -> dict[str, Any]:
        """``POST /inference/v1/generate``: token-in/token-out generation (``--enable-scale-out``).

        ``resend``: a kept-alive connection the server closed as it was reused (it still answers ``/health``) is
        tried once more on a new connection, under the request id with ``-resent`` appended (the same seed and
        version: the same tokens); a server that does not answer raises ``requests``' exception.
        """
        import requests

        try:
            return self.post("/inference/v1/generate", body)
        except requests.ConnectionError:
            if not resend or not self.health():
                raise
        return self.post("/inference/v1/generate", {**body, "request_id": f"{body['request_id']}-resent"})

    def openapi_routes(self) -> set[str]:
        """The paths the server's OpenAPI schema lists."""
        return set(self.get("/openapi.json")["paths"])

    # Weight-sync routes (VLLM_SERVER_DEV_MODE=1).
    def config(self) -> dict[str, Any]:
        """The server's whole ``vllm_config`` (``GET /server_info?config_format=json``)."""
        return self.get("/server_info", config_format="json")["vllm_config"]

    def is_paused(self) -> bool:
        """Whether the server is paused (a publication under way, or one that failed there)."""
        return bool(self.get("/is_paused").get("is_paused"))

    def pause(self) -> None:
        """Drain: running requests finish, nothing new is scheduled, the prefix cache is cleared."""
        self.post("/pause", mode="wait", clear_cache="true")

    def resume(self) -> None:
        """Schedule requests again."""
        self.post("/resume")

    def weight_version(self) -> str | None:
        """The weight version the server reports (``GET /weight_info``)."""
        return self.get("/weight_info").get("weight_version")

    def set_weight_version(self, version: int) -> None:
        """Report ``version`` from now on (``POST /update_weight_version``)."""
        self.post("/update_weight_version", {"new_version": str(version)})

    def world_size(self) -> int:
        """The server's weight-transfer workers (``GET /get_world_size``)."""
        return int(self.get("/get_world_size")["world_size"])

    def collective_rpc(self, method: str) -> list[Any]:
        """Each worker's answer to the worker-extension method ``method`` (``POST /collective_rpc``)."""
        return list(self.post("/collective_rpc", {"method": method}).get("results") or [])

    # LoRA at runtime (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1).
    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the adapter at ``path`` as ``name``, replacing one of that name in place."""
        self.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path, "load_inplace": True})

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name``."""
        self.post("/v1/unload_lora_adapter", {"lora_name": name})

    def _answer(self, method: str, response: Any) -> Any:
        if response.status_code != 200:
            raise ServerError(method, response.url, response.status_code, response.text)
        try:
            return response.json() if response.content else {}
        except ValueError:  # a route that answers in words (vLLM's LoRA routes: "Success: LoRA adapter ... added")
            return {}


class ThreadClients:
    """One :class:`ServerClient` per thread and server (a ``requests`` session is not shared between threads).

    Args:
        timeout_s: Seconds each call of the clients it makes may take.
    """

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._local = threading.local()

    def of(self, url: str) -> ServerClient:
        """This thread's client of the server at ``url``."""
        clients = self._local.__dict__.setdefault("clients", {})
        if url not in clients:
            clients[url] = ServerClient(url, self.timeout_s)
        return clients[url]
