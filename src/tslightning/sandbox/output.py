"""Bounded capture of a command's output: keep the head and the tail, count and drop the middle."""

from __future__ import annotations


class BoundedOutput:
    """Accumulates output chunks in bounded memory: at most 1.5 × ``max_bytes`` plus one chunk.

    The first ``max_bytes // 2`` bytes and the last ``max_bytes - max_bytes // 2`` are kept; everything between is
    counted and dropped, so memory stays bounded however much the command prints.

    Args:
        max_bytes: bytes kept in all; at least 2.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 2:
            raise ValueError(f"max_bytes must be >= 2 (got {max_bytes})")
        self._head_limit = max_bytes // 2
        self._tail_limit = max_bytes - self._head_limit
        self._head = bytearray()
        self._tail = bytearray()
        self.total_bytes = 0
        """Bytes received so far, kept or not."""

    def append(self, chunk: bytes) -> None:
        self.total_bytes += len(chunk)
        room = self._head_limit - len(self._head)
        if room > 0:
            self._head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self._tail += chunk
            # Trim lazily (at twice the limit) so that trimming costs O(1) amortized per byte.
            if len(self._tail) > 2 * self._tail_limit:
                del self._tail[: len(self._tail) - self._tail_limit]

    @property
    def truncated(self) -> bool:
        return self.total_bytes > self._head_limit + self._tail_limit

    def text(self) -> str:
        """The kept output decoded as UTF-8 (``errors="replace"``), with a marker line where the middle was dropped."""
        tail = bytes(self._tail[-self._tail_limit :]) if self._tail else b""
        if not self.truncated:
            return (bytes(self._head) + tail).decode("utf-8", errors="replace")
        dropped = self.total_bytes - len(self._head) - len(tail)
        marker = f"\n[... {dropped} bytes of output truncated ...]\n"
        return self._head.decode("utf-8", errors="replace") + marker + tail.decode("utf-8", errors="replace")
