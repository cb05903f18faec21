"""Tool observations as the policy sees them: the command's output, kept as head and tail tokens (Table 6)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_WINDOW_CHARS = 16384
"""Text tokenized at least at each end of an output before any of it is cut: outputs up to twice this are tokenized
whole (and the marker counts omitted tokens exactly)."""
CHARS_PER_TOKEN = 8
"""First guess of characters per token when sizing the text windows; they double until they hold the token window."""
WINDOW_MARGIN_TOKENS = 16
"""Tokens beyond the window each text window must yield, so its cut end never touches a kept token."""


@dataclass(frozen=True)
class ObservationWindow:
    """How much of a long tool output is retained: the first ``head_tokens`` and last ``tail_tokens`` tokens.

    Table 6 keeps 4,096 tokens per tool call, head and tail equally (2,048 each).
    """

    head_tokens: int = 2048
    tail_tokens: int = 2048

    def __post_init__(self) -> None:
        for name in ("head_tokens", "tail_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"ObservationWindow.{name} must be >= 0; got {getattr(self, name)}")


def keep_head_and_tail(
    token_ids: Sequence[int], window: ObservationWindow, marker: Callable[[int], Sequence[int]]
) -> tuple[list[int], int]:
    """Keep the window's head and tail of ``token_ids``, joined by ``marker(omitted)`` when anything was dropped.

    Returns the retained ids and how many were omitted (0 when the output fits).
    """
    ids = list(token_ids)
    if len(ids) <= window.head_tokens + window.tail_tokens:
        return ids, 0
    omitted = len(ids) - window.head_tokens - window.tail_tokens
    tail = ids[len(ids) - window.tail_tokens :] if window.tail_tokens else []
    return ids[: window.head_tokens] + list(marker(omitted)) + tail, omitted


def status_line(exit_code: int | None, timed_out: bool, limit_hit: str | None) -> str:
    """How a command ended, appended after its (possibly shortened) output so the policy always sees it."""
    status = f"[exit code {exit_code}]" if exit_code is not None else "[no exit code]"
    if timed_out:
        status = "[command timed out and was killed]"
    elif limit_hit:
        status += f" [limit hit: {limit_hit}]"
    return status


def keep_text_head_and_tail(
    text: str,
    window: ObservationWindow,
    encode: Callable[[str], Sequence[int]],
    marker: Callable[[int, int], Sequence[int]],
) -> list[int]:
    """The token ids of ``text`` that ``window`` keeps, tokenizing only a bounded head and tail of the text.

    A command's output can be a mebibyte; tokenizing all of it to keep 4,096 tokens costs seconds. Instead the first
    and last ``max(MIN_WINDOW_CHARS, CHARS_PER_TOKEN × window tokens)`` characters are tokenized, each window doubling
    until it yields ``window + WINDOW_MARGIN_TOKENS`` tokens (so it certainly covers the token window, whatever the
    tokenizer's characters per token) or the two windows cover the whole text. Kept are the head window's first
    ``head_tokens`` and the tail window's last ``tail_tokens`` ids.

    Args:
        text: the output.
        window: how many tokens to keep at each end.
        encode: the tokenizer (no special tokens added).
        marker: ``marker(omitted_tokens, omitted_chars)``: the ids joining head and tail when anything was dropped;
            ``omitted_chars`` is 0 when the whole text was tokenized (``omitted_tokens`` is then exact), else the
            characters never tokenized, and ``omitted_tokens`` counts the dropped tokens of the two windows.
    """
    head_chars = max(MIN_WINDOW_CHARS, CHARS_PER_TOKEN * window.head_tokens) if window.head_tokens else 0
    tail_chars = max(MIN_WINDOW_CHARS, CHARS_PER_TOKEN * window.tail_tokens) if window.tail_tokens else 0
    while head_chars + tail_chars < len(text):
        head = list(encode(text[:head_chars])) if head_chars else []
        tail = list(encode(text[len(text) - tail_chars :])) if tail_chars else []
        grow_head = head_chars and len(head) < window.head_tokens + WINDOW_MARGIN_TOKENS
        grow_tail = tail_chars and len(tail) < window.tail_tokens + WINDOW_MARGIN_TOKENS
        if not grow_head and not grow_tail:
            dropped = len(head) - window.head_tokens + len(tail) - window.tail_tokens
            kept_tail = tail[len(tail) - window.tail_tokens :] if window.tail_tokens else []
            omitted_chars = len(text) - head_chars - tail_chars
            return head[: window.head_tokens] + list(marker(dropped, omitted_chars)) + kept_tail
        head_chars, tail_chars = head_chars * (2 if grow_head else 1), tail_chars * (2 if grow_tail else 1)
    kept, _ = keep_head_and_tail(encode(text), window, lambda omitted: marker(omitted, 0))
    return kept
