"""One live environment per attempt: every agent command runs in the same bubblewrap sandbox, as in a Harbor
container, and what a command leaves running (a server started with ``&``) is there for the next one.

The environment starts at the first command: one bwrap with the namespaces, binds, seccomp filter and private
``/tmp`` of :class:`~tslightning.sandbox.bubblewrap.BubblewrapSandbox`, whose pid 1 is
:mod:`~tslightning.sandbox.session_init`. Each command is then one ``bash -c`` that pid 1 forks on request, in its
own session, under the command's kernel limits, working directory and environment; memory and disk are watched over
the whole environment (background processes included). On the host, each command is a small client process (what
``supervise`` starts, drains, times out and kills): it hands its stdout, readiness and status descriptors to pid 1
and waits for the command's exit code, so output bounds, time-outs and results are exactly those of the per-command
backend. A killed client (time-out, output flood) makes pid 1 kill the command's process group.

What each command sees: ``/app`` (writable) and ``/oracle`` (read-only; the reference solution, when one runs).
A verifier run (``verifier=True``, or mounts beyond those two) runs while the agent's processes are still alive, as
in Harbor: a fresh sandbox beside the environment, in its network namespace and on its files, under another host uid
and in namespaces of its own (:mod:`~tslightning.sandbox.live_verification`), with ``/tests`` copied in only then;
the environment ends when it returns, before its reward files are read. Where that cannot be (the trainer is not
root, so there is no second uid to run it as; ``nsenter`` or ``setpriv`` missing; the environment is not running),
the environment ends first and the verifier runs in a fresh per-command sandbox (in the attempt's shared network
when it has one: :attr:`~tslightning.sandbox.bubblewrap.BubblewrapSandbox.network`, where helper services answer).
With an attempt network the environment starts in it rather than in a network of its own, so a restart (the next
step of a multi-step task) finds the same services. :meth:`close` (the attempt's end)
ends it too; bwrap's ``--die-with-parent`` ends it if the trainer dies.
"""

from __future__ import annotations

import marshal
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Collection, Mapping
from dataclasses import replace

from tslightning.sandbox.attempt import MOUNT_POINTS, AttemptDirectory, Mount, validate_mounts
from tslightning.sandbox.base import DEFAULT_PATH, command_environment, kernel_limits
from tslightning.sandbox.bubblewrap import (
    DEFAULT_UNPRIVILEGED_UID,
    RUN_DIR,
    BubblewrapSandbox,
    _Descriptors,
    _unlock_mount_points,
)
from tslightning.sandbox.errors import SandboxError
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.live_verification import (
    DEFAULT_VERIFIER_UID,
    beside_argv,
    environment_argv,
    hand_over_to_verifier,
)
from tslightning.sandbox.result import CommandResult
from tslightning.sandbox.supervision import CommandRequest, Launch

LIVE_MOUNTS: tuple[Mount, ...] = ("app", "oracle")
"""What the live environment shows; a command that needs more (a verifier's ``/tests``, ``/logs``) ends it."""
START_TIMEOUT_S = 30.0
END_TIMEOUT_S = 10.0
STARTUP_SETTLE_S = 2.0
"""Longest wait, once an environment with a start-up command has started, for that command to listen on a port."""
_TCP_LISTEN = "0A"
_TMPFS_POINTS = ("/tmp", "/dev/shm")

_CLIENT = """\
import os, socket, sys
connection = socket.socket(fileno=int(sys.argv[1]))
socket.send_fds(connection, [b"."], [1, int(sys.argv[2]), int(sys.argv[3])])
for fd in (1, int(sys.argv[2]), int(sys.argv[3])):
    os.close(fd)
reply = connection.recv(16)
sys.exit(int(reply) if reply.strip().isdigit() else 125)
"""
"""The host side of one command: hand the descriptors over, wait for the exit code (125: the environment died)."""


class LiveBubblewrapSandbox(BubblewrapSandbox):
    """A :class:`BubblewrapSandbox` whose agent commands share one live environment (see the module docstring).

    Args:
        attempt: the attempt whose directories the commands see.
        limits: the default limits of every ``run``; the environment's memory, disk and ``/tmp`` size are those of
            the first command's limits.
        unprivileged_uid: host uid of the sandbox when the trainer is root.
        verifier_uid: host uid of verifier runs beside the environment (when the trainer is root).

    Raises:
        SandboxUnavailableError: as :class:`BubblewrapSandbox`.
        ValueError: ``verifier_uid`` is not a positive uid other than ``unprivileged_uid``.
    """

    read_only_mounts: tuple[Mount, ...] = ("tests", "oracle")

    def __init__(
        self,
        attempt: AttemptDirectory,
        *,
        limits: SandboxLimits | None = None,
        unprivileged_uid: int = DEFAULT_UNPRIVILEGED_UID,
        verifier_uid: int = DEFAULT_VERIFIER_UID,
    ) -> None:
        if verifier_uid <= 0 or verifier_uid == unprivileged_uid:
            raise ValueError(f"verifier_uid must be > 0 and differ from unprivileged_uid (got {verifier_uid})")
        super().__init__(attempt, limits=limits, unprivileged_uid=unprivileged_uid)
        self.verifier_uid = verifier_uid
        self._netns: int | None = None
        """The environment's network namespace, open (a verifier beside it enters it)."""
        self._keeper: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._keeper_log = None
        self._keeper_pid: int | None = None
        """Host pid of the environment's pid 1 (bwrap's child)."""
        self._lock = threading.RLock()  # a failed start ends the environment under the lock
        self.starts = 0
        """How many times the environment was started (a verifier run ends it; the next agent command restarts)."""
        self.startup: tuple[str, str, Mapping[str, str]] | None = None
        """``(command, cwd, env)`` run in the background at every start of the environment (an image's ``CMD``)."""

    @property
    def live(self) -> bool:
        """Whether the environment is running."""
        return self._keeper is not None and self._keeper.poll() is None

    def _launch(self, request: CommandRequest) -> Launch:
        if request.verifier or not set(request.mounts) <= set(LIVE_MOUNTS):
            with self._lock:
                beside = self._launch_beside(request)
            if beside is not None:
                return beside
            self.end()  # nothing the agent left running outlives into a per-command verifier run
            return super()._launch(request)
        with self._lock:
            self._ensure_live(request.limits)
            return self._request(request)

    def run(
        self,
        command: str,
        *,
        limits: SandboxLimits | None = None,
        mounts: Collection[Mount] = ("app",),
        cwd: str = "/app",
        env: Mapping[str, str] | None = None,
        verifier: bool = False,
    ) -> CommandResult:
        """As :meth:`Sandbox.run`; a verifier run (``verifier=True`` or mounts beyond :data:`LIVE_MOUNTS`) runs
        beside the environment and ends it when it returns (see the module docstring)."""
        try:
            ends = verifier or not set(validate_mounts(mounts)) <= set(LIVE_MOUNTS)
        except ValueError:
            ends = False  # the run itself raises the message
        try:
            return super().run(command, limits=limits, mounts=mounts, cwd=cwd, env=env, verifier=verifier)
        except SandboxError:
            if not (ends and self.live):
                raise
            # Beside the environment it could not start (the agent locked its working directory, say): the
            # environment ends and it runs as in a per-command sandbox, which any such sabotage only costs reward.
            self.end()
            return super().run(command, limits=limits, mounts=mounts, cwd=cwd, env=env, verifier=verifier)
        finally:
            if ends:
                self.end()

    def _launch_beside(self, request: CommandRequest) -> Launch | None:
        """The launch of a verifier run beside the running environment, or None where it cannot run beside it."""
        if self._host_uid is None or not self.live or self._netns is None:
            return None
        mounts = request.mounts
        hand_over_to_verifier(self.attempt, mounts, self._host_uid, self.verifier_uid, self.kept_owners())
        _unlock_mount_points(self.attempt, tuple(mount for mount in mounts if mount != "logs"))
        joined = not self.agent_network and not self.network_for(request.verifier)  # else: the host's, or its own
        launch = self._bwrap_launch(request, joined_network=joined)
        netns = os.dup(self._netns) if joined else None  # inheritable; ``supervise`` closes it once started
        agents = [self.attempt.host_path(mount) for mount in mounts if mount in LIVE_MOUNTS]
        agents += [*self.root.writable.values(), *self.root.files.values()] if self.root is not None else []
        argv = beside_argv(self.verifier_uid, self._host_uid, netns, agents, launch.argv)
        pass_fds = (*launch.pass_fds, *([netns] if netns is not None else []))
        return replace(launch, argv=argv, user=None, pass_fds=pass_fds)

    def start(self, limits: SandboxLimits | None = None) -> None:
        """Start the environment now (and its start-up command) rather than at the first command; idempotent.

        Raises:
            SandboxError: it did not start (bwrap's or pid 1's message included).
        """
        with self._lock:
            self._ensure_live(limits or self.limits)

    def _ensure_live(self, limits: SandboxLimits) -> None:
        self._hand_over_mounts(LIVE_MOUNTS, self.kept_owners())
        _unlock_mount_points(self.attempt, LIVE_MOUNTS)
        if not self.live:
            self._start(limits)

    def _request(self, request: CommandRequest) -> Launch:
        """The launch of an agent's command inside the running environment (its pid 1 forks it)."""
        self._pin_keeper()
        config = {"command": request.command, "shell": "/bin/bash", "cwd": request.cwd}
        config |= {"rlimits": kernel_limits(request.limits), "env": self.agent_env(request.env)}
        host_end, keeper_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        passed = _Descriptors()  # the configuration (any command length) travels in a memory file
        try:
            socket.send_fds(self._control, [b"."], [keeper_end.fileno(), int(passed.data(marshal.dumps(config)))])
        except OSError as error:
            host_end.close()
            raise SandboxError(f"the attempt's live environment stopped answering: {error}") from error
        finally:
            keeper_end.close()
            passed.close()
        status_read, status_write = os.pipe()
        client_fd = host_end.detach()
        client = [str(client_fd), str(request.ready_fd), str(status_write)]
        return Launch(
            argv=[sys.executable, "-I", "-S", "-B", "-c", _CLIENT, *client],
            env={"PATH": DEFAULT_PATH},
            pass_fds=(client_fd, status_write),
            status_fd=status_read,
        )

    def _pin_keeper(self) -> None:
        """Give pid 1 the calling thread's CPU affinity, so the command it forks next runs on the cores the caller
        (a rollout worker) is pinned to, as a per-command sandbox would; nothing inside may change it (seccomp)."""
        if self._keeper_pid is None:
            return
        try:
            os.sched_setaffinity(self._keeper_pid, os.sched_getaffinity(0))
        except OSError:
            pass  # pid 1 is gone: the command's start reports it

    def _start(self, limits: SandboxLimits) -> None:
        """Start the environment's bwrap and wait until its pid 1 serves."""
        passed = _Descriptors()
        control, keeper_control = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        started_read, started_write = os.pipe()
        passed.fds += [keeper_control.detach(), started_write]
        try:
            environment = {
                "memory_bytes": limits.memory_bytes,
                "disk_bytes": limits.disk_bytes,
                "disk_paths": [MOUNT_POINTS[mount] for mount in LIVE_MOUNTS],
                "tmpfs_paths": list(_TMPFS_POINTS),
                "started_fd": started_write,
            }
            if self.startup is not None:
                command, cwd, env = self.startup
                environment["startup"] = {
                    "command": command, "shell": "/bin/bash", "rlimits": kernel_limits(limits), "cwd": cwd,
                    "env": self.agent_env(command_environment(env)),
                }  # fmt: skip
            own_network = self._host_uid is not None and (self.network is not None or not self.network_for(False))
            options = self._options(limits, LIVE_MOUNTS, "/", {}, False, passed, joined_network=own_network)
            init = [self.interpreter, "-I", "-S", "-B", f"{RUN_DIR}/session_init.py", str(passed.fds[0])]
            init.append(passed.data(marshal.dumps(environment)))
            options_fd = passed.data(b"".join(os.fsencode(option) + b"\0" for option in options))
            argv = [self._bwrap, "--args", options_fd, "--", *init]
            if own_network:  # the root launcher makes the network (or enters the attempt's), then becomes the bwrap
                netns = os.dup(self.network.fd) if self.network is not None else None
                passed.fds += [netns] if netns is not None else []
                argv = environment_argv(self._host_uid, argv, netns)
            self._keeper_log = tempfile.TemporaryFile(prefix="tsl-live-")
            self._keeper = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=self._keeper_log,
                stderr=subprocess.STDOUT,
                env={"PATH": DEFAULT_PATH},
                start_new_session=True,
                pass_fds=tuple(passed.fds),
                user=None if own_network else self._host_uid,
                group=None if own_network else self._host_uid,
                extra_groups=[] if self._host_uid is not None and not own_network else None,
            )
        except BaseException:
            control.close()
            os.close(started_read)
            raise
        finally:
            passed.close()
        self._control = control
        self.starts += 1
        self._wait_started(started_read)
        if self.startup is not None:
            self._await_listener()

    def _await_listener(self) -> None:
        """Give a start-up command up to :data:`STARTUP_SETTLE_S` to listen on a port before the first command runs
        (Harbor's agent set-up gives an image's service seconds; here the first command follows at once)."""
        deadline = time.monotonic() + STARTUP_SETTLE_S
        while self._keeper_pid is not None and not _listening(self._keeper_pid) and time.monotonic() < deadline:
            time.sleep(0.05)

    def _wait_started(self, started_read: int) -> None:
        try:
            ready, _, _ = select.select([started_read], [], [], START_TIMEOUT_S)
            started = bool(ready) and os.read(started_read, 1) == b"."
        finally:
            os.close(started_read)
        if not started:
            log = self._log_tail()
            self.end()
            raise SandboxError(f"the attempt's live environment did not start: {log or 'no output'}")
        self._keeper_pid = _first_child(self._keeper.pid)
        try:
            self._netns = os.open(f"/proc/{self._keeper_pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, TypeError):
            self._netns = None  # a verifier then runs after the environment ended

    def _log_tail(self) -> str:
        if self._keeper_log is None:
            return ""
        self._keeper_log.seek(0)
        return self._keeper_log.read().decode("utf-8", "replace").strip()[-2000:]

    def end(self) -> None:
        """End the environment: every process in it is killed (its pid 1 exits). Idempotent; the next agent command
        starts a fresh one (files under ``/app`` stay)."""
        with self._lock:
            keeper, control, log, netns = self._keeper, self._control, self._keeper_log, self._netns
            self._keeper = self._control = self._keeper_log = self._keeper_pid = self._netns = None
        if netns is not None:
            os.close(netns)
        if control is not None:
            control.close()  # pid 1 reads EOF and exits; the kernel kills the rest of the namespace
        if keeper is not None:
            try:
                keeper.wait(timeout=END_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(keeper.pid, 9)
                keeper.wait()
        if log is not None:
            log.close()

    def close(self) -> None:
        self.end()


def _listening(pid: int) -> bool:
    """Whether a TCP socket listens in the network namespace of process ``pid`` (``/proc/PID/net/tcp``, ``tcp6``)."""
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}", encoding="ascii") as sockets:
                if any(line.split()[3:4] == [_TCP_LISTEN] for line in sockets.readlines()[1:]):
                    return True
        except OSError:
            continue
    return False


def _first_child(pid: int) -> int | None:
    """The first child of host process ``pid`` (bwrap's: the sandbox's pid 1), or None."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as file:
            children = file.read().split()
    except OSError:
        return None
    return int(children[0]) if children else None


__all__ = ["LIVE_MOUNTS", "LiveBubblewrapSandbox"]
