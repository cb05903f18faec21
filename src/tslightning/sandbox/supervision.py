"""Run one launched command to completion under a wall clock and an output bound, and report what stopped it.

Every backend ends here: the backend says how to launch (``Launch``); this module
spawns it in a new session with stdout and stderr on one pipe, drains that pipe into a ``BoundedOutput`` (the child
never blocks on a full pipe), kills the tree on timeout or output flood, sweeps the process group once the launched
process exits (background jobs do not outlive a command), and classifies the result.
"""

from __future__ import annotations

import contextlib
import marshal
import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from tslightning.sandbox.attempt import Mount
from tslightning.sandbox.errors import SandboxError
from tslightning.sandbox.limits import OUTPUT_KILL_FACTOR, SandboxLimits
from tslightning.sandbox.output import BoundedOutput
from tslightning.sandbox.result import CommandResult, LimitName, OrphanProcess

_CHUNK = 64 * 1024
_GRACE_S = 5.0
"""How long to keep draining after a kill or after the launched process exited, before giving up on the pipe."""

# Kernel limits announce themselves in what the failing program prints; signals (SIGXFSZ, SIGXCPU) are exact.
_EVIDENCE: tuple[tuple[LimitName, re.Pattern[str]], ...] = (
    ("processes", re.compile(r"fork: (retry: )?Resource temporarily unavailable|Cannot fork|can't start new thread")),
    ("memory", re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|[Oo]ut of memory")),
    ("file_size", re.compile(r"File size limit exceeded|File too large")),
    ("cpu", re.compile(r"CPU time limit exceeded")),
)
_SIGNAL_LIMITS: Mapping[str, LimitName] = {"SIGXFSZ": "file_size", "SIGXCPU": "cpu"}


@dataclass(frozen=True)
class CommandRequest:
    """One command a sandbox was asked to run, validated, from which its backend builds a :class:`Launch`."""

    command: str
    """Shell text, as typed in a terminal (run with ``bash -c``)."""
    limits: SandboxLimits
    mounts: tuple[Mount, ...]
    """The attempt's directories the command sees (``MOUNT_POINTS``)."""
    cwd: str
    """Absolute working directory inside the sandbox."""
    env: Mapping[str, str]
    """The command's whole environment (``BASE_ENVIRONMENT`` and the run's variables)."""
    ready_fd: int
    """Write end of the readiness pipe (see :attr:`Launch.reports_readiness`)."""
    verifier: bool = False
    """Run as a task's verifier (the backend's protections of the verifier's own processes apply)."""


@dataclass(frozen=True)
class Launch:
    """How a backend starts the process that runs one command."""

    argv: Sequence[str]
    env: Mapping[str, str]
    """The launched process's whole environment (nothing is inherited from the trainer)."""
    cwd: str | None = None
    user: int | None = None
    """Host uid (and gid) to start as; None keeps the trainer's."""
    reports_readiness: bool = True
    """The launched wrapper writes one byte to the readiness descriptor once the sandbox is set up and the limits are
    in place; a launch that exits without it failed to start, and ``supervise`` raises instead of returning."""
    stop_outside_group: Callable[[], None] | None = None
    """Stops what the launch started outside its own process group (a container); called when the sandbox kills
    the command, after SIGKILL to the group."""
    pass_fds: tuple[int, ...] = ()
    """Further descriptors the launched process inherits under the same numbers (bwrap's arguments, filter, init
    sources, configuration); ``supervise`` closes them once the process is started."""
    status_fd: int | None = None
    """Read end of the pipe on which the sandbox's init writes its status (see
    :mod:`tslightning.sandbox.init_process`); ``supervise`` reads and closes it once the command is over."""


def supervise(build_launch: Callable[[int], Launch], limits: SandboxLimits) -> CommandResult:
    """Launch, drain, time out, sweep, and classify one command.

    Args:
        build_launch: given the readiness descriptor (a pipe's write end, inherited by the launched process under
            the same number), returns the launch.
        limits: ``timeout_s`` and ``max_output_bytes`` are enforced here; the rest by the backend.

    Returns:
        The result; killing, time-outs and limits are reported in it, never raised.

    Raises:
        SandboxError: the sandbox could not start the command (its own error message is included).
    """
    ready_read, ready_write = os.pipe()
    launch: Launch | None = None
    try:
        launch = build_launch(ready_write)
        start = time.monotonic()
        try:
            proc = _spawn(launch, ready_write)
        finally:
            _close(launch.pass_fds)
        os.close(ready_write)
        ready_write = -1
        try:
            output, killed_for = _drain(proc, limits, launch.stop_outside_group)
        finally:
            _reap(proc)
        duration = time.monotonic() - start
        started = _read_ready(ready_read)
        status = _read_status(launch.status_fd)
    finally:
        _close(
            fd for fd in (ready_read, ready_write, launch.status_fd if launch else None) if fd is not None and fd >= 0
        )
    if launch.reports_readiness and not started and killed_for is None:
        raise SandboxError(
            f"the sandbox could not start the command (launcher exit status {proc.returncode}): "
            f"{output.text().strip()[-2000:]}"
        )
    return _result(proc.returncode, output, killed_for, duration, status)


def _spawn(launch: Launch, ready_write: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        list(launch.argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(launch.env),
        cwd=launch.cwd,
        start_new_session=True,  # its own process group, so the whole tree can be killed at once
        pass_fds=(ready_write, *launch.pass_fds),
        user=launch.user,
        group=launch.user,
        extra_groups=[] if launch.user is not None else None,
    )


def _drain(
    proc: subprocess.Popen[bytes], limits: SandboxLimits, stop_outside_group: Callable[[], None] | None
) -> tuple[BoundedOutput, LimitName | None]:
    """Read the pipe until EOF and the launched process's exit; kill on timeout or output flood."""

    def kill(reason: LimitName) -> None:
        nonlocal killed_for, deadline
        killed_for = reason
        _kill_process_group(proc)
        if stop_outside_group is not None:
            stop_outside_group()
        deadline = time.monotonic() + _GRACE_S

    assert proc.stdout is not None
    output = BoundedOutput(limits.max_output_bytes)
    kill_at_bytes = OUTPUT_KILL_FACTOR * limits.max_output_bytes
    deadline = time.monotonic() + limits.timeout_s
    killed_for: LimitName | None = None
    out_fd = proc.stdout.fileno()
    pid_fd = os.pidfd_open(proc.pid)  # readable once the launched process exits, without reaping it
    with selectors.DefaultSelector() as selector:
        selector.register(out_fd, selectors.EVENT_READ)
        selector.register(pid_fd, selectors.EVENT_READ)
        try:
            while selector.get_map():
                wait = deadline - time.monotonic()
                if wait <= 0:
                    if killed_for is not None or pid_fd not in selector.get_map():
                        break  # processes outside the group still hold the pipe: stop waiting for them
                    kill("timeout")
                    continue
                for key, _ in selector.select(wait):
                    if key.fd == pid_fd:
                        selector.unregister(pid_fd)
                        # The leader is a zombie until reaped, so its process group id cannot be reused yet.
                        _kill_process_group(proc)
                        deadline = min(deadline, time.monotonic() + _GRACE_S)
                        continue
                    chunk = os.read(out_fd, _CHUNK)
                    if not chunk:
                        selector.unregister(out_fd)
                        continue
                    output.append(chunk)
                    if output.total_bytes > kill_at_bytes and killed_for is None:
                        kill("output")
        finally:
            os.close(pid_fd)
    return output, killed_for


def _reap(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=_GRACE_S)
    except subprocess.TimeoutExpired:
        _kill_process_group(proc)
        proc.kill()
        proc.wait()
    finally:
        if proc.stdout is not None:
            proc.stdout.close()


def _kill_process_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _close(fds) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _read_status(fd: int | None) -> dict | None:
    """The init's status, or None when it wrote none (it was killed: timeout, output flood)."""
    if fd is None:
        return None
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, _CHUNK):
            chunks.append(chunk)
    try:
        status = marshal.loads(b"".join(chunks))  # written by the sandbox's init only, never by the command
    except (EOFError, ValueError, TypeError):
        return None
    return status if isinstance(status, dict) else None


def _read_ready(fd: int) -> bool:
    os.set_blocking(fd, False)
    try:
        return bool(os.read(fd, 1))
    except BlockingIOError:
        return False


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None


def _result(
    returncode: int, output: BoundedOutput, killed_for: LimitName | None, duration: float, status: dict | None
) -> CommandResult:
    watched = status or {}
    killed_for = killed_for or watched.get("limit")  # the init's watch over the whole command
    exit_code: int | None
    if killed_for is not None:
        exit_code, signal_name = None, "SIGKILL"
    elif returncode < 0:
        exit_code, signal_name = 128 - returncode, _signal_name(-returncode)
    else:
        exit_code, signal_name = returncode, _signal_name(returncode - 128) if returncode > 128 else None
    text = output.text()
    orphans = tuple(OrphanProcess(o["pid"], o["name"], o["died_ns"]) for o in watched.get("orphans", ()))
    return CommandResult(
        exit_code=exit_code,
        output=text,
        timed_out=killed_for == "timeout",
        output_truncated=output.truncated,
        signal=signal_name,
        limit_hit=classify_limit(text, signal_name, killed_for, output.truncated),
        duration_s=duration,
        orphans=orphans,
        orphan_count=watched.get("orphan_count", 0),
        last_orphan_death_ns=watched.get("last_orphan_death_ns"),
        peak_memory_bytes=watched.get("peak_memory_bytes"),
        disk_bytes=watched.get("disk_bytes"),
    )


def classify_limit(
    output: str, signal_name: str | None, killed_for: LimitName | None, truncated: bool
) -> LimitName | None:
    """Which limit stopped or constrained a command, in order of how much it explains.

    0. The sandbox's own watch over the whole command (``memory``, ``disk``: exact, it killed the command).
    1. A kernel limit: its signal (SIGXFSZ → ``file_size``, SIGXCPU → ``cpu``; exact), else the message the failing
       program printed (``fork: retry: Resource temporarily unavailable`` → ``processes``, ``MemoryError`` /
       ``Cannot allocate memory`` → ``memory``, ...; a heuristic over the kept output: a command can print these
       words itself).
    2. The sandbox's own kill: ``timeout`` or ``output`` (flood).
    3. ``output`` when the output was truncated although the command ended by itself.

    A fork bomb that runs into the process limit and is then timed out is therefore ``processes`` (with
    ``timed_out`` True).
    """
    if killed_for in ("memory", "disk"):
        return killed_for
    if signal_name in _SIGNAL_LIMITS:
        return _SIGNAL_LIMITS[signal_name]
    for limit, pattern in _EVIDENCE:
        if pattern.search(output):
            return limit
    if killed_for is not None:
        return killed_for
    return "output" if truncated else None
