"""What one sandboxed command did: exit status, the output an agent would see, and which limit stopped it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LimitName = Literal["timeout", "memory", "file_size", "processes", "cpu", "output"]


@dataclass(frozen=True)
class CommandResult:
    """The outcome of ``Sandbox.run``; never raised, always returned, whatever the command did."""

    exit_code: int | None
    """The status a shell would show as ``$?`` (128 + N when signal N ended the command), or None when the sandbox
    itself killed the command (timeout, output flood)."""
    output: str
    """stdout and stderr interleaved in the order written, as in a terminal, decoded as UTF-8 with
    ``errors="replace"``. When truncated, the head and tail are joined by a line naming the bytes dropped."""
    timed_out: bool
    """True when the wall-clock limit passed and the command was killed."""
    output_truncated: bool
    """True when the command wrote more than ``max_output_bytes`` and the middle was dropped."""
    signal: str | None
    """Name of the signal that ended the command (``"SIGKILL"``, ``"SIGXFSZ"``, ...), else None. Inside a
    sandbox, a signal death is seen as exit status 128 + N, so a command that itself exits 137 reads as SIGKILL,
    as it would in a shell."""
    limit_hit: LimitName | None
    """Which limit stopped or constrained the command, when detectable (see ``tslightning.sandbox.supervision``):
    evidence of a kernel limit (processes, memory, file_size, cpu) first, then the sandbox's own kill (timeout,
    output), then a truncated output."""
    duration_s: float
    """Wall-clock seconds from launch until the command and all its processes were gone."""

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within its limits."""
        return self.exit_code == 0 and not self.timed_out
