"""Resource limits of one sandboxed command: wall clock, CPU, memory, file size, processes, captured output."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

_MIN_MEMORY_BYTES = 16 * 2**20
_MIN_OUTPUT_BYTES = 64


@dataclass(frozen=True)
class SandboxLimits:
    """What one command may use before it is stopped; every backend applies all of them.

    ``timeout_s``, ``max_processes``, ``memory_bytes`` and ``disk_bytes`` bound the whole command; ``cpu_seconds``
    and ``file_size_bytes`` bind each process (or file) separately. Where each is enforced, per backend: see
    README's "Tasks and the agent sandbox" and :class:`~tslightning.sandbox.bubblewrap.BubblewrapSandbox`.

    Raises:
        ValueError: at construction, naming every field whose value is invalid.
    """

    timeout_s: float = 120.0
    """Wall-clock limit in seconds, from launch to exit. When it passes, the whole process tree is killed with
    SIGKILL and the result reports ``timed_out``."""
    cpu_seconds: int = 120
    """CPU time per process (RLIMIT_CPU): SIGXCPU at this many seconds, SIGKILL one second later."""
    memory_bytes: int = 2 * 2**30
    """Memory of the command, twice: the address space of each process (RLIMIT_AS, rounded down to KiB: allocations
    beyond it fail with MemoryError / ENOMEM; runtimes that reserve large virtual ranges up front, such as the JVM
    or Go, may need more), and the resident memory of all its processes together (the sandbox's init sums it every
    0.1 s and kills the whole command beyond it: ``limit_hit="memory"``)."""
    file_size_bytes: int = 256 * 2**20
    """Largest file any process may write (RLIMIT_FSIZE), rounded down to KiB: a larger write fails with SIGXFSZ or
    EFBIG. Bounds each file; ``disk_bytes`` bounds the total."""
    disk_bytes: int = 10 * 2**30
    """Disk the attempt may use in all: its writable directories (``/app``, and ``/logs/verifier`` / ``/oracle``
    when mounted) and the private ``/tmp`` and ``/dev/shm``, each file, directory or link counting at least 4 KiB
    (so the number of files is bounded too). The sandbox's init sums it every 0.25 s or more and
    kills the command once the total exceeds this (or what was already used when the command started, if more):
    ``limit_hit="disk"``. Between two checks a command can overshoot by what it writes in that time."""
    max_processes: int = 256
    """Tasks (processes and threads) alive at once in the command (RLIMIT_NPROC, counted per sandbox: see
    ``BubblewrapSandbox``); a fork beyond it fails with EAGAIN."""
    max_output_bytes: int = 1 * 2**20
    """Captured stdout+stderr: the first and the last half of this many bytes are kept, the middle is read and
    dropped, and a marker says how much. A command that writes more than ``OUTPUT_KILL_FACTOR`` times this is
    killed."""
    tmp_bytes: int = 512 * 2**20
    """Size of the private in-memory ``/tmp`` (and ``/dev/shm``) where the backend provides one (at most
    ``disk_bytes``)."""

    def __post_init__(self) -> None:
        problems = [problem for f in fields(self) if (problem := self._problem(f.name)) is not None]
        if problems:
            raise ValueError("invalid sandbox limits:\n  " + "\n  ".join(problems))

    def _problem(self, name: str) -> str | None:
        value = getattr(self, name)
        if name == "timeout_s":
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                return f"sandbox.limits.timeout_s must be a finite number of seconds > 0 (got {value!r})"
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return f"sandbox.limits.{name} must be an int (got {value!r})"
        minimum = {
            "memory_bytes": _MIN_MEMORY_BYTES,
            "max_output_bytes": _MIN_OUTPUT_BYTES,
            "tmp_bytes": 2**20,
            "disk_bytes": 2**20,
        }
        floor = minimum.get(name, 1)
        if value < floor:
            return f"sandbox.limits.{name} must be >= {floor} (got {value!r})"
        return None


OUTPUT_KILL_FACTOR = 8
"""A command whose output exceeds ``OUTPUT_KILL_FACTOR * max_output_bytes`` is killed (``limit_hit="output"``):
everything past the kept head and tail is discarded anyway, and a flood (``yes``, ``cat /dev/urandom``) would
otherwise burn CPU until the timeout."""
