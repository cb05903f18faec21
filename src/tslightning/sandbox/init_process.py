"""The first process of every bubblewrap sandbox (pid 1): it starts the command, watches the whole process tree and
the attempt's disk use, and reports how the command ended.

It runs *inside* the sandbox, under the trainer's Python interpreter in isolated mode (``python -I -S -B``), so it
imports only the standard library and :mod:`file_tree`, which is shipped beside it. As pid 1 of the sandbox's PID
namespace it reaps every orphan, cannot be signalled from inside (the kernel drops signals to a namespace's init
unless it handles them), and when it exits the kernel kills every process left in the namespace before bwrap
returns. It makes itself non-dumpable, so no process inside can ptrace it or write its memory.

One command (the configuration is read from the descriptor named in argv, see :func:`main`):

1. Fork. The child sets the kernel limits (RLIMIT_CPU, AS, FSIZE, NPROC), restores default signal handling, reports
   readiness on ``ready_fd`` and executes ``shell -c COMMAND``; a command too long for one argument (the kernel's
   128 KiB ``MAX_ARG_STRLEN``) is read by the shell from descriptor 3 instead (``shell /dev/fd/3``).
2. Every tick: reap; with ``kill_orphans`` (verifier runs), kill at once every process orphaned while the command
   runs — a process whose parent exited, so nothing of the command waits for it any more — and note when it died;
   sum the resident memory of all processes (PSS, when the cheaper RSS sum is over the limit) and kill everything
   when it exceeds ``memory_bytes``; every few tenths of a second sum the disk used in ``disk_paths`` and the tmpfs
   mounts and kill everything when it exceeds ``max(disk_bytes, usage when the command started)``.
3. When the command exits or a watchdog fires: SIGKILL every other process, reap them, write the status on
   ``status_fd`` and exit with the command's status (128 + N when signal N ended it).

The status: ``exit_code`` or ``signal`` of the command, ``limit`` (``"memory"`` / ``"disk"`` / None), ``orphans``
(the first few orphans killed or reaped, with ``pid``, ``name``, ``died_ns``), ``orphan_count``,
``last_orphan_death_ns`` (``CLOCK_REALTIME``; with ``kill_orphans``, the direct children of the command still
running when it exits are its background jobs, not orphans), ``peak_memory_bytes`` and ``disk_bytes``.
"""

from __future__ import annotations

import ctypes
import marshal
import os
import resource
import select
import signal
import sys
import time

try:
    from tslightning.sandbox.file_tree import disk_usage
except ImportError:  # inside the sandbox: shipped beside this file, whose directory ``python -I`` leaves off sys.path
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from file_tree import disk_usage  # type: ignore[no-redef]

MAX_ARGUMENT_BYTES = 128 * 1024 - 1
"""Longest command passed as one argument (the kernel's ``MAX_ARG_STRLEN`` less the terminating NUL)."""
COMMAND_FD = 3
_PR_SET_DUMPABLE = 4
_ORPHAN_TICK_S = 0.01
_TICK_S = 0.05
_MEMORY_EVERY_S = 0.1
_DISK_MIN_EVERY_S = 0.25
_DISK_COST_FACTOR = 10
"""The disk walk runs at most 1/10 of the time: its interval is at least 10 times its last duration."""
_REPORTED_ORPHANS = 16
_RLIMITS = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "fsize": resource.RLIMIT_FSIZE}
_RLIMITS["nproc"] = resource.RLIMIT_NPROC


def main(argv: list[str]) -> int:
    """``init_process.py CONFIG_FD``: run the command described by the configuration on ``CONFIG_FD``; returns the
    exit code. Configuration and status are ``marshal``-encoded dicts of plain values (any Python >= 3.9 reads them;
    ``json`` would cost each command 15 ms of imports)."""
    if os.getpid() != 1:  # it ends by killing every process it can signal: only ever inside its own PID namespace
        raise SystemExit("init_process.py runs only as pid 1 of a sandbox's PID namespace")
    with os.fdopen(int(argv[1]), "rb") as config_file:
        config = marshal.loads(config_file.read())
    os.set_inheritable(config["status_fd"], False)
    _harden()
    wake_read = _wake_on_child_exit()
    command_pid = _start(config)
    os.close(config["ready_fd"])
    warden = Warden(config, command_pid)
    status = warden.run(wake_read)
    with os.fdopen(config["status_fd"], "wb") as status_file:
        status_file.write(marshal.dumps(status))
    return _exit_code(status)


def _harden() -> None:
    """No ptrace or /proc/1/mem access by the processes it runs; signals from inside cannot end it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(number, signal.SIG_DFL)  # pid 1 with the default disposition: the kernel drops them


def _wake_on_child_exit() -> int:
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    return read_end


def _start(config: dict, new_session: bool = False) -> int:
    """Fork the command (in a session of its own with ``new_session``); the child never returns."""
    command = config["command"].encode("utf-8", "surrogateescape")
    shell = config["shell"]
    argv = [shell, "-c", command] if len(command) <= MAX_ARGUMENT_BYTES else [shell, f"/dev/fd/{COMMAND_FD}"]
    script_fd = _script(command) if len(argv) == 2 else None
    pid = os.fork()
    if pid == 0:  # the child; the init has no other threads, so Python code is safe here until exec
        try:
            if new_session:
                os.setsid()
            _become_command(config, argv, script_fd)
        finally:
            os._exit(126)
    if script_fd is not None:
        os.close(script_fd)
    return pid


def _script(command: bytes) -> int:
    fd = os.memfd_create("command")  # close-on-exec until the child duplicates it onto COMMAND_FD
    view = memoryview(command)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _become_command(config: dict, argv: list, script_fd: int | None) -> None:
    signal.set_wakeup_fd(-1)
    for number in range(1, signal.NSIG):
        if number not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(number, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    try:
        limits = config["rlimits"]
        for name, number in _RLIMITS.items():
            resource.setrlimit(number, tuple(limits[name]))
    except (OSError, ValueError) as error:
        os.write(2, f"tsl-sandbox: cannot set the limits: {error}\n".encode())
        return
    if "cwd" in config:  # a live environment's command (session_init): its own directory and variables
        try:
            os.chdir(config["cwd"])
        except OSError as error:
            os.write(2, f"tsl-sandbox: cannot enter {config['cwd']}: {error.strerror}\n".encode())
            return
    os.write(config["ready_fd"], b".")
    if script_fd is not None:
        os.dup2(script_fd, COMMAND_FD)
    # Only stdin, stdout, stderr (and the script) reach the command: no descriptor of the sandbox's setup.
    os.closerange(COMMAND_FD + 1 if script_fd is not None else COMMAND_FD, os.sysconf("SC_OPEN_MAX"))
    try:
        if "env" in config:
            os.execve(argv[0], argv, config["env"])
        os.execv(argv[0], argv)
    except OSError as error:
        os.write(2, f"tsl-sandbox: cannot run {argv[0]}: {error}\n".encode())


class Warden:
    """The watch over one command's processes, memory and disk, from pid 1 (see the module docstring)."""

    def __init__(self, config: dict, command_pid: int) -> None:
        self.config = config
        self.command_pid = command_pid
        self.kill_orphans = bool(config["kill_orphans"])
        self.command_status: int | None = None
        self.background: set[int] = set()
        """Direct children of the command seen while it ran (its own background jobs)."""
        self.orphans: list[dict] = []
        self.orphan_count = 0
        self.last_orphan_death_ns: int | None = None
        self.limit: str | None = None
        self.peak_memory = 0
        self.disk_bytes = 0
        self._disk_allowed: int | None = None
        self._next_memory = 0.0
        self._next_disk = 0.0

    def run(self, wake_read: int) -> dict:
        """Watch until the command exits or a watchdog fires; then kill and reap the rest. Returns the status."""
        tick = _ORPHAN_TICK_S if self.kill_orphans else _TICK_S
        while self.command_status is None and self.limit is None:
            self._reap()
            if self.command_status is not None:
                break
            now = time.monotonic()
            if self.kill_orphans:
                self._kill_orphans()
            if now >= self._next_memory:
                self._watch_memory()
                self._next_memory = now + _MEMORY_EVERY_S
            if now >= self._next_disk and self.limit is None:
                self._watch_disk()
            select.select([wake_read], [], [], tick)
            _drain(wake_read)
        self._end_all()
        return self.status()

    def status(self) -> dict:
        code = self.command_status
        exited = code is not None and os.WIFEXITED(code)
        return {
            "exit_code": os.WEXITSTATUS(code) if exited else None,
            "signal": os.WTERMSIG(code) if code is not None and os.WIFSIGNALED(code) else None,
            "limit": self.limit,
            "orphans": self.orphans,
            "orphan_count": self.orphan_count,
            "last_orphan_death_ns": self.last_orphan_death_ns,
            "peak_memory_bytes": self.peak_memory,
            "disk_bytes": self.disk_bytes,
        }

    def _reap(self) -> None:
        while True:
            try:
                pid, code = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._reaped(pid, code, name=None)

    def _reaped(self, pid: int, code: int, name: str | None) -> None:
        if pid == self.command_pid:
            self.command_status = code
        elif self.kill_orphans and pid not in self.background:
            self._note_orphan(pid, name)

    def _note_orphan(self, pid: int, name: str | None) -> None:
        died = time.time_ns()
        self.orphan_count += 1
        self.last_orphan_death_ns = died
        if len(self.orphans) < _REPORTED_ORPHANS:
            self.orphans.append({"pid": pid, "name": name or "?", "died_ns": died})

    def _kill_orphans(self) -> None:
        """Kill every child of pid 1 but the command (orphans: their parent exited); remember its own children."""
        self.background.update(_children(self.command_pid))
        for pid in _children(1):
            if pid != self.command_pid:
                name = _name(pid)
                _kill(pid)
                self._wait_for(pid, name)

    def _wait_for(self, pid: int, name: str | None) -> None:
        try:
            _, code = os.waitpid(pid, 0)
        except ChildProcessError:
            return
        self._reaped(pid, code, name)

    def _watch_memory(self) -> None:
        pids = [pid for pid in _all_pids() if pid != 1]
        used = sum(_rss(pid) for pid in pids)
        if used > self.config["memory_bytes"]:
            used = sum(_pss(pid) for pid in pids)  # RSS counts shared pages once per process: check precisely
        self.peak_memory = max(self.peak_memory, used)
        if used > self.config["memory_bytes"]:
            self.limit = "memory"

    def _watch_disk(self) -> None:
        started = time.monotonic()
        used = sum(_disk_usage(path) for path in self.config["disk_paths"])
        used += sum(_tmpfs_usage(path) for path in self.config["tmpfs_paths"])
        self.disk_bytes = used
        if self._disk_allowed is None:
            self._disk_allowed = max(self.config["disk_bytes"], used)
        elif used > self._disk_allowed:
            self.limit = "disk"
        cost = time.monotonic() - started
        self._next_disk = time.monotonic() + max(_DISK_MIN_EVERY_S, _DISK_COST_FACTOR * cost)

    def _end_all(self) -> None:
        """SIGKILL everything else in the namespace and reap it; the command's own background jobs are not orphans."""
        if self.kill_orphans and self.command_status is None:
            self.background.update(_children(self.command_pid))
        names = {pid: _name(pid) for pid in _all_pids() if pid != 1}
        _kill(-1)  # from pid 1: every process of the namespace but itself
        while True:
            try:
                pid, code = os.waitpid(-1, 0)
            except ChildProcessError:
                return
            self._reaped(pid, code, names.get(pid))


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads), from /proc/PID/task/TID/children."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as file:
                found.extend(int(child) for child in file.read().split())
        except OSError:
            continue
    return found


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _name(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as file:
            return file.read().strip()
    except OSError:
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:  # gone already
        pass


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as file:
            return int(file.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            for line in file:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return _rss(pid)


def _disk_usage(path: str) -> int:
    try:
        return disk_usage(path, unlock=True)
    except OSError:
        return 0  # the tree changed while it was walked; the next walk counts it


def _tmpfs_usage(path: str) -> int:
    try:
        info = os.statvfs(path)
    except OSError:
        return 0
    return (info.f_blocks - info.f_bfree) * info.f_frsize


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:  # empty
        pass


def _exit_code(status: dict) -> int:
    if status["signal"] is not None:
        return 128 + status["signal"]
    if status["exit_code"] is not None:
        return status["exit_code"]
    return 128 + signal.SIGKILL


if __name__ == "__main__":
    sys.exit(main(sys.argv))
