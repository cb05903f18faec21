"""Pid 1 of a live environment: one sandbox for a whole attempt, running each command on request.

Like :mod:`init_process` (whose command start and watch it reuses), it runs inside the sandbox under the trainer's
Python in isolated mode, is non-dumpable and cannot be signalled from inside; when it exits the kernel kills every
process left in the namespace. Unlike it, it outlives each command: processes a command leaves running (a server
started with ``&``) keep running, in the same namespaces, ``/tmp`` and network, for the next command, until the
environment ends.

Protocol (``socket.send_fds`` on Unix sequenced-packet sockets): the host sends, on the control socket named in
argv, one message per command with two descriptors: the command's own connection, and a memory file holding the
``marshal``-encoded configuration (as :mod:`init_process` reads it, with ``cwd`` and ``env``; a command of any
length). On that connection the host's client process sends
its stdout, the readiness descriptor and the status descriptor; when the command ends, the status goes to the
status descriptor (as :mod:`init_process` writes it) and its exit code, as text, to the connection. A connection that
closes first (the client was killed: the command's time-out or output flood) kills the command's process group.

An environment may have a start-up command (``startup`` in its configuration: an image's ``CMD``), started before the
first command in its own session, its output appended to ``/tmp/startup.log``.

Per command: its own session and process group, the kernel limits, the working directory and environment; its
output is relayed to the client's stdout until its shell exits, then later output of what it left running is read
and dropped (nothing it leaves holds the client's pipe open). Throughout the environment's life, the memory of all
its processes and the disk of the attempt are watched against the limits the environment was started with: past
one, every process but pid 1 is killed (the running command reports the limit).
"""

from __future__ import annotations

import marshal
import os
import select
import socket
import sys
import time

try:
    from tslightning.sandbox import init_process
except ImportError:  # inside the sandbox: shipped beside this file
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import init_process  # type: ignore[no-redef]

STARTUP_LOG = "/tmp/startup.log"
"""Where the start-up command's output goes (the agent may read it, as ``docker logs``)."""
_IDLE_TICK_S = 0.2
_CHUNK = 64 * 1024


def main(argv: list[str]) -> int:
    """``session_init.py CONTROL_FD CONFIG_FD``: serve commands until the control socket closes."""
    if os.getpid() != 1:
        raise SystemExit("session_init.py runs only as pid 1 of a sandbox's PID namespace")
    with os.fdopen(int(argv[2]), "rb") as config_file:
        environment = marshal.loads(config_file.read())
    control = socket.socket(fileno=int(argv[1]))
    init_process._harden()
    wake_read = init_process._wake_on_child_exit()
    keeper = Keeper(environment, wake_read)
    if environment.get("startup"):
        keeper.start_service(environment["startup"])
    os.write(environment["started_fd"], b".")
    os.close(environment["started_fd"])
    while True:
        ready, _, _ = select.select([control, wake_read, *keeper.dropped], [], [], _IDLE_TICK_S)
        keeper.tend(ready)
        if control in ready:
            try:
                message, fds, _, _ = socket.recv_fds(control, 16, 2)
            except OSError:
                return 0
            if not message:
                return 0  # the host closed the environment
            try:
                with os.fdopen(fds[1], "rb") as request:
                    config = marshal.loads(request.read())
                keeper.serve(config, socket.socket(fileno=fds[0]))
            except Exception as error:  # noqa: BLE001 - one command's trouble never ends the environment
                print(f"tsl-sandbox: a command could not be served: {error!r}", file=sys.stderr)


class Keeper:
    """Runs commands one at a time and tends to what they leave running between them."""

    def __init__(self, environment: dict, wake_read: int) -> None:
        self.environment = environment
        self.wake_read = wake_read
        self.dropped: set[int] = set()
        """Output pipes of finished commands that background processes still hold: read and dropped."""
        self.warden = init_process.Warden({**environment, "kill_orphans": False}, command_pid=-1)

    def tend(self, ready: list) -> None:
        """Between commands: reap, drop late output, watch memory and disk."""
        init_process._drain(self.wake_read)
        self.warden._reap()
        for fd in [fd for fd in self.dropped if fd in ready]:
            self._drop(fd)
        self._watch()

    def start_service(self, config: dict) -> None:
        """Start the environment's start-up command (an image's ``CMD``) in its own session, its output appended to
        :data:`STARTUP_LOG`; it runs until the environment ends."""
        log = os.open(STARTUP_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        ready_read, ready_write = os.pipe2(os.O_CLOEXEC)
        try:
            self._start({**config, "ready_fd": ready_write}, log)
        finally:
            _close(log, ready_write, ready_read)

    def serve(self, config: dict, connection: socket.socket) -> None:
        """Run one command (see the module docstring) and answer on ``connection``."""
        connection.settimeout(30)
        try:
            _, fds, _, _ = socket.recv_fds(connection, 16, 3)
        except OSError:
            connection.close()
            return
        if len(fds) != 3:
            _close(*fds)
            connection.close()
            return
        client_out, ready_fd, status_fd = fds
        relay_read, relay_write = os.pipe2(os.O_CLOEXEC)
        try:
            pid = self._start({**config, "ready_fd": ready_fd}, relay_write)
        except OSError as error:  # no fork (the processes left running hold the process limit): a result, not a crash
            status = self._unstarted(error, ready_fd, client_out)
            _close(relay_read)
        else:
            _close(relay_write, ready_fd)
            status = self._watch_command(pid, relay_read, client_out, connection)
        _close(client_out)
        try:  # the host may have stopped listening (a time-out): pid 1 carries on regardless
            with os.fdopen(status_fd, "wb") as status_file:
                status_file.write(marshal.dumps(status))
        except OSError:
            pass
        try:
            connection.sendall(str(init_process._exit_code(status)).encode())
        except OSError:
            pass
        connection.close()

    def _unstarted(self, error: OSError, ready_fd: int, client_out: int) -> dict:
        """The status of a command that could not be forked (exit status 126, bash's "cannot execute")."""
        try:
            os.write(client_out, f"tsl-sandbox: cannot start the command: {error.strerror}\n".encode())
            os.write(ready_fd, b".")
        except OSError:
            pass
        _close(ready_fd)
        self.warden.command_pid, self.warden.command_status, self.warden.limit = -1, 126 << 8, None
        return self.warden.status()

    def _start(self, config: dict, output: int) -> int:
        """Fork the command in its own session, its stdout and stderr on ``output``."""
        saved = [os.dup(0), os.dup(1), os.dup(2)]
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(output, 1)
        os.dup2(output, 2)
        try:
            return init_process._start(config, new_session=True)
        finally:
            for fd, saved_fd in enumerate(saved):
                os.dup2(saved_fd, fd)
            _close(null, *saved)

    def _watch_command(self, pid: int, relay: int, client_out: int, connection: socket.socket) -> dict:
        warden = self.warden
        warden.command_pid, warden.command_status, warden.limit = pid, None, None
        warden.peak_memory = 0
        cancelled, relaying = False, True
        while warden.command_status is None and warden.limit is None:
            watched = [self.wake_read, connection, *self.dropped, *([relay] if relaying else [])]
            ready, _, _ = select.select(watched, [], [], 0.05)
            if relay in ready and not _relay(relay, client_out):
                relaying = False  # every writer closed it (the command may still run): stop polling an EOF
                ready.remove(relay)
            if connection in ready and not _alive(connection):
                cancelled = True
                break
            self.tend(ready)
        if cancelled or warden.limit is not None:
            _kill_group(pid)
            if warden.limit is not None:
                init_process._kill(-1)  # past the environment's memory or disk: nothing of it keeps running
            warden._wait_for(pid, None)
        while _relay(relay, client_out, block=False):
            pass
        self.dropped.add(relay)
        return warden.status()

    def _watch(self) -> None:
        now = time.monotonic()
        warden = self.warden
        if now >= warden._next_memory:
            warden._watch_memory()
            warden._next_memory = now + init_process._MEMORY_EVERY_S
        if now >= warden._next_disk and warden.limit is None:
            warden._watch_disk()
        if warden.limit is not None and warden.command_status is not None:
            init_process._kill(-1)  # between commands, a service past the limits ends with everything else
            warden.limit = None

    def _drop(self, fd: int) -> None:
        try:
            chunk = os.read(fd, _CHUNK)
        except OSError:
            chunk = b""
        if not chunk:
            self.dropped.discard(fd)
            _close(fd)


def _relay(source: int, target: int, block: bool = True) -> bool:
    """Copy one chunk from ``source`` to ``target``; False at EOF (or nothing ready when not ``block``)."""
    if not block and not select.select([source], [], [], 0)[0]:
        return False
    try:
        chunk = os.read(source, _CHUNK)
    except OSError:
        return False
    if not chunk:
        return False
    try:
        view = memoryview(chunk)
        while view:
            view = view[os.write(target, view) :]
    except OSError:
        pass  # the client is gone: keep reading, so the command never blocks on its output
    return True


def _alive(connection: socket.socket) -> bool:
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, 9)
    except OSError:
        pass


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main(sys.argv))
