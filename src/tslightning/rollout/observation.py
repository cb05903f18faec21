"""Tool observations as the policy sees them: the command's output, kept as head and tail tokens (Table 6)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


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
