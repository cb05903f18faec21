"""What one sandboxed command did: exit status, the output an agent would see, and which limit stopped it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LimitName = Literal["timeout", "memory", "disk", "file_size", "processes", "cpu", "output"]
"""The limit that stopped or constrained a command (``CommandResult.limit_hit``)."""


@dataclass(frozen=True)
class OrphanProcess:
    """A process orphaned while a verifier ran (its parent exited, so nothing of the verifier waited for it), which
    the sandbox killed (or reaped) at once."""

    pid: int
    """Its pid inside the sandbox."""
    name: str
    """Its command name (``/proc/PID/comm``), ``"?"`` when it was gone before it could be read."""
    died_ns: int
    """``CLOCK_REALTIME`` nanoseconds (as ``time.time_ns``) by which it was dead."""


@dataclass(frozen=True)
class CommandResult:
    """The outcome of ``Sandbox.run``; never raised, always returned, whatever the command did."""

    exit_code: int | None
    """The status a shell would show as ``$?`` (128 + N when signal N ended the command), or None when the sandbox
    itself killed the command (timeout, output flood, memory or disk of the whole command), or did not run it
    (a command with a NUL character)."""
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
    the sandbox's own watch over the whole command (memory, disk) first, then evidence of a kernel limit (processes,
    memory, file_size, cpu), then the sandbox's own kill (timeout, output), then a truncated output."""
    duration_s: float
    """Wall-clock seconds from launch until the command and all its processes were gone."""
    orphans: tuple[OrphanProcess, ...] = ()
    """Verifier runs (``Sandbox.run(..., verifier=True)``): the first orphans killed (see ``orphan_count``)."""
    orphan_count: int = 0
    """Verifier runs: how many processes were orphaned while the command ran (all killed at once)."""
    last_orphan_death_ns: int | None = None
    """Verifier runs: ``CLOCK_REALTIME`` nanoseconds by which the last orphan was dead; None when there was none.
    A file last changed before then may have been written by an orphan."""
    peak_memory_bytes: int | None = None
    """The largest resident memory of the whole command seen by the sandbox's watch (None where not watched)."""
    disk_bytes: int | None = None
    """Disk used by the attempt's writable directories and private ``/tmp`` at the last check (None where not
    watched)."""

    @property
    def ok(self) -> bool:
        """True when the command exited 0 within its limits."""
        return self.exit_code == 0 and not self.timed_out
