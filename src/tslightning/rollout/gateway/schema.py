"""The OpenAI request and response bodies the gateway speaks: ``/v1/chat/completions`` and ``/v1/completions``,
non-streaming and streaming (server-sent events), with the sampled tokens' log-probs on request.

Sampling is the run's, never the harness's: every call samples π_θk at the run's temperature with top-p 1 and the
run's seed for that turn, because the learner differentiates exactly that distribution. A request that asks for
another distribution (another temperature, top-p, penalties, logit biases), several choices, stop strings, tools
or alternative log-probs is refused with a 400 naming the field, never silently served differently; ``seed`` and
``user`` are accepted and ignored (the run seeds each turn), ``max_tokens`` / ``max_completion_tokens`` cap the turn
below the run's limits.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from tslightning.rollout.gateway.errors import GatewayError

__all__ = ["CallRequest", "Answer", "parse_chat", "parse_completion", "response_body", "stream_events"]

_REFUSED_IF_SET = {
    "tools": "tools are not rendered by this gateway: configure the harness for text actions",
    "functions": "functions are not rendered by this gateway: configure the harness for text actions",
    "tool_choice": "tool_choice needs tools, which this gateway does not render",
    "stop": "stop strings would cut the sampled ids: the turn ends at the policy's end-of-turn token",
    "logit_bias": "logit_bias changes the sampling distribution the learner differentiates",
    "response_format": "constrained decoding changes the sampling distribution the learner differentiates",
    "suffix": "suffix (insertion) is not served",
    "echo": "echo is not served",
}
_ZERO_OR_ABSENT = ("presence_penalty", "frequency_penalty", "top_logprobs")


@dataclass(frozen=True)
class CallRequest:
    """What a call asks for, validated.

    Attributes:
        prompt: The chat messages (role and text content) or the completion prompt (text or token ids).
        chat: A chat completion (``prompt`` is messages) or a completion.
        max_tokens: The caller's cap on generated tokens (``None``: the run's per-turn limit).
        stream: Answer as server-sent events.
        include_usage: Streaming: send a last chunk with the token usage.
        logprobs: Return the sampled tokens' log-probs.
    """

    prompt: list[dict[str, str]] | str | list[int]
    chat: bool
    max_tokens: int | None
    stream: bool
    include_usage: bool
    logprobs: bool


@dataclass(frozen=True)
class Answer:
    """One answered call, for the response body."""

    call_id: str
    model: str
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    token_texts: tuple[str, ...]
    """Each sampled id's text (only when log-probs were asked for)."""
    finish_reason: str
    prompt_tokens: int
    policy_version: int
    turn: int
    segment: int


def parse_chat(body: Any, temperature: float) -> CallRequest:
    """A ``/v1/chat/completions`` body, checked; raises :class:`GatewayError` (400) naming the field."""
    _check_common(body, temperature)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise GatewayError(400, "invalid_value", "messages must be a non-empty list of messages", "messages")
    return CallRequest([_message(m, i) for i, m in enumerate(messages)], True, *_options(body, "max_completion_tokens"))


def parse_completion(body: Any, temperature: float) -> CallRequest:
    """A ``/v1/completions`` body (prompt: text, token ids, or a one-element list of either), checked."""
    _check_common(body, temperature)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids:
        raise GatewayError(400, "invalid_value", "prompt must be one non-empty text or one list of token ids", "prompt")
    return CallRequest(prompt, False, *_options(body, "max_tokens"))


def response_body(answer: Answer, chat: bool, logprobs: bool) -> dict[str, Any]:
    """The non-streaming body of ``answer`` (``chat.completion`` or ``text_completion``)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": answer.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": answer.text}
        if logprobs:
            choice["logprobs"] = {"content": _token_logprobs(answer)}
    else:
        choice["text"] = answer.text
        if logprobs:
            choice["logprobs"] = {
                "tokens": list(answer.token_texts),
                "token_logprobs": list(answer.logprobs),
                "top_logprobs": None,
                "text_offset": _offsets(answer.token_texts),
            }
    return {**_envelope(answer, chat, streamed=False), "choices": [choice], "usage": _usage(answer)}


def stream_events(answer: Answer, chat: bool, logprobs: bool, include_usage: bool) -> list[bytes]:
    """The server-sent events of ``answer``: the text in one chunk, the finish reason, usage if asked, ``[DONE]``.

    The whole turn is sampled before it is answered (the engine returns a turn at once), so streaming costs
    nothing extra and a client reading chunks gets the same text and ids.
    """
    head = _envelope(answer, chat, streamed=True)
    if chat:
        delta = {"role": "assistant", "content": answer.text}
        first = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        if logprobs:
            first["logprobs"] = {"content": _token_logprobs(answer)}
        last = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": answer.finish_reason}
    else:
        first = {"index": 0, "text": answer.text, "logprobs": None, "finish_reason": None}
        if logprobs:
            first["logprobs"] = {"tokens": list(answer.token_texts), "token_logprobs": list(answer.logprobs)}
        last = {"index": 0, "text": "", "logprobs": None, "finish_reason": answer.finish_reason}
    chunks = [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(answer)})
    return [f"data: {json.dumps(chunk)}\n\n".encode() for chunk in chunks] + [b"data: [DONE]\n\n"]


def _check_common(body: Any, temperature: float) -> None:
    if not isinstance(body, dict):
        raise GatewayError(400, "invalid_request_body", "the request body must be a JSON object")
    for name, why in _REFUSED_IF_SET.items():
        if body.get(name) not in (None, [], {}, "", False):
            raise GatewayError(400, "unsupported_parameter", f"{name}: {why}; remove it", name)
    for name in _ZERO_OR_ABSENT:
        if body.get(name) not in (None, 0):
            raise GatewayError(400, "unsupported_parameter", f"{name} must be 0 or absent; got {body[name]!r}", name)
    for name, expected in (("temperature", temperature), ("top_p", 1.0), ("n", 1), ("best_of", 1)):
        value = body.get(name)
        if value is not None and value != expected:
            raise GatewayError(
                400,
                "unsupported_parameter",
                f"{name} {value!r}: every call samples the policy with {name} {expected} (the distribution the "
                f"learner trains); remove {name} from the harness's model settings",
                name,
            )


def _options(body: dict, cap_name: str) -> tuple[int | None, bool, bool, bool]:
    cap = body.get(cap_name, body.get("max_tokens"))
    if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
        raise GatewayError(400, "invalid_value", f"{cap_name} must be an integer >= 1; got {cap!r}", cap_name)
    options = body.get("stream_options") or {}
    logprobs = body.get("logprobs")  # chat: a bool; completions: an int (alternatives are not returned)
    wanted = bool(logprobs) if cap_name == "max_completion_tokens" else logprobs is not None
    return cap, bool(body.get("stream")), bool(options.get("include_usage")), wanted


def _message(message: Any, index: int) -> dict[str, str]:
    """``message`` as the chat template sees it: role and text content (text parts joined)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise GatewayError(400, "invalid_value", f"{where} must be an object with a role", where)
    if message.get("tool_calls") or message.get("function_call"):
        raise GatewayError(400, "unsupported_parameter", f"{where} holds tool calls, which are not rendered", where)
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise GatewayError(400, "unsupported_parameter", f"{where}.content: only text parts are served", where)
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise GatewayError(400, "invalid_value", f"{where}.content must be text; got {content!r}", where)
    return {"role": message["role"], "content": content}


def _envelope(answer: Answer, chat: bool, streamed: bool) -> dict[str, Any]:
    kind = ("chat.completion.chunk" if streamed else "chat.completion") if chat else "text_completion"
    return {
        "id": answer.call_id,
        "object": kind,
        "created": int(time.time()),
        "model": answer.model,
        "system_fingerprint": f"tslightning-policy-v{answer.policy_version}",
        # Not OpenAI's: what was sampled, for a harness or test that wants the ids and the version.
        "tslightning": {
            "policy_version": answer.policy_version,
            "turn": answer.turn,
            "segment": answer.segment,
            "token_ids": list(answer.token_ids),
        },
    }


def _usage(answer: Answer) -> dict[str, int]:
    generated = len(answer.token_ids)
    return {
        "prompt_tokens": answer.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": answer.prompt_tokens + generated,
    }


def _token_logprobs(answer: Answer) -> list[dict[str, Any]]:
    return [
        {"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
        for text, logprob in zip(answer.token_texts, answer.logprobs, strict=True)
    ]


def _offsets(texts: tuple[str, ...]) -> list[int]:
    offsets, position = [], 0
    for text in texts:
        offsets.append(position)
        position += len(text)
    return offsets
