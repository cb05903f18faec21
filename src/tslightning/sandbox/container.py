"""Container backends (the docker and podman CLIs): one container per attempt, one ``exec`` per command.

As Harbor runs a task: the attempt's container starts from the task's image (``docker run -d``, kept alive by
``sleep infinity`` under ``--init``; the image's start-up command, if any, is then started detached with ``exec -d``),
and every command of the attempt is an ``exec`` in it, so files, ``/tmp`` and processes persist between commands.
The engine applies the limits to the whole container (``--memory`` = ``--memory-swap``, ``--pids-limit``,
``--cpus``, a size-bounded ``/tmp``, no capabilities beyond Docker's defaults minus ``NET_RAW``, no new privileges,
``--network none`` unless the network is allowed); each command also gets the kernel limits of
:func:`~tslightning.sandbox.base.limits_script` and the wall clock and output bounds of ``supervise``. A command that
times out is killed inside the container (its shell and children), not only its ``exec`` client.

``/app`` is the image's own (the task's files as its Dockerfile placed them). ``/tests`` and ``/oracle`` are copied in
(``cp``) just before a run that needs them; a verifier run starts with an empty ``/logs/verifier`` whose files are
copied back to the attempt's ``logs/`` afterwards, where the reward is read. The container is removed (``rm -f``) when
the sandbox closes, when it fails to start, and at the trainer's exit for any still running.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import uuid
import weakref
from collections.abc import Collection
from pathlib import Path

from tslightning.sandbox.attempt import MOUNT_POINTS, AttemptDirectory, Mount
from tslightning.sandbox.base import DEFAULT_PATH, Sandbox, limits_script
from tslightning.sandbox.compose import compose_argv, compose_available, compose_override
from tslightning.sandbox.errors import SandboxError, SandboxUnavailableError
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.result import CommandResult
from tslightning.sandbox.supervision import CommandRequest, Launch

CONTROL_TIMEOUT_S = 60.0
"""Wall clock of the engine calls around commands (start, copy, kill, remove)."""
_ENGINE_PREFIXES = ("DOCKER_", "PODMAN_", "CONTAINER_", "CONTAINERS_", "BUILDAH_")
_RUNNING: weakref.WeakSet[ContainerSandbox] = weakref.WeakSet()


class ContainerSandbox(Sandbox):
    """One container per attempt through an engine's CLI (see the module docstring).

    Args:
        attempt: the attempt whose ``tests/``, ``oracle/`` and ``logs/`` are copied in and out.
        image: the image the container runs (a task's ``docker_image`` or its built Dockerfile).
        engine: ``docker`` or ``podman`` (the CLI on ``PATH``, answering ``info``).
        limits: the default limits of every ``run``; the container's memory, processes and ``/tmp`` are the first
            command's.
        cpus: CPUs the container may use (``[environment] cpus``).
        network: share a network with the outside (``bridge``) instead of ``none``.
        start_command: run detached in the container once it starts (an image's ``CMD``).
        workdir: where the start-up command runs.

    Raises:
        SandboxUnavailableError: the CLI is missing or no engine answers ``info``.
    """

    def __init__(
        self,
        attempt: AttemptDirectory,
        *,
        image: str,
        engine: str = "docker",
        limits: SandboxLimits | None = None,
        cpus: float = 1.0,
        network: bool = False,
        start_command: str | None = None,
        workdir: str = "/app",
    ) -> None:
        super().__init__(attempt, limits=limits)
        self.cli = engine_cli(engine)
        self.image = image
        self.cpus = cpus
        self.network = network
        self.start_command = start_command
        self.workdir = workdir
        self.name = f"tsl-attempt-{uuid.uuid4().hex[:16]}"
        self.compose_file: Path | None = None
        """The task's compose file, when it has helper containers: the attempt then runs them all with
        ``compose`` (:mod:`~tslightning.sandbox.compose`), its commands in the ``main`` service."""
        self.compose_env: dict[str, str] = {}
        """What the compose file's ``${VAR}`` values name (the task's ``[environment] env``, Harbor's variables)."""
        self.compose_timeout_s = CONTROL_TIMEOUT_S
        """Wall clock of ``compose up`` (it builds the helpers' images, then waits for them to be healthy)."""
        self.started = False
        self._commands = 0

    def run(self, command: str, *, mounts: Collection[Mount] = ("app",), **options) -> CommandResult:
        """``Sandbox.run`` in the attempt's container, with ``/tests`` and ``/oracle`` copied in first and a
        verifier's ``/logs/verifier`` copied back after (see the module docstring)."""
        if not self.started:
            self._start(options.get("limits") or self.limits)
        for mount in ("tests", "oracle"):
            if mount in mounts:
                self._copy_in(mount)
        if "logs" in mounts:
            self._engine("exec", self.name, "sh", "-c", "rm -rf /logs/verifier && mkdir -p /logs/verifier")
        try:
            result = super().run(command, mounts=mounts, **options)
        finally:
            for env_file in self.attempt.root.glob(".tsl-env-*"):
                env_file.unlink()
        if "logs" in mounts:
            self._copy_out("logs")
        return result

    def _launch(self, request: CommandRequest) -> Launch:
        self._commands += 1
        pid_file = f"/tmp/.tsl-command-{self._commands}.pid"
        # The shell's pid goes to a file first, so a time-out can kill the command inside the container.
        wrapper = f'echo $$ > {pid_file}; exec /bin/bash -c "$1" tsl-sandbox "$2"'
        # The variables go in a private file, not argv (the process list) nor the client's own environment.
        env_file = self.attempt.root / f".tsl-env-{self._commands}"
        descriptor = os.open(env_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as file:
            file.writelines(f"{name}={value}\n" for name, value in request.env.items() if "\n" not in value)
        argv = [self.cli, "exec", "--workdir", request.cwd, "--env-file", str(env_file)]
        script = limits_script(request.limits, ready_fd=None)
        argv += [self.name, "/bin/bash", "-c", wrapper, "tsl-sandbox", script, request.command]
        return Launch(
            argv=argv,
            env={**engine_environment(), "PATH": DEFAULT_PATH},
            reports_readiness=False,
            stop_outside_group=lambda: self._kill_command(pid_file),
        )

    def _start(self, limits: SandboxLimits) -> None:
        if self.compose_file is not None:
            self._start_compose(limits)
            return
        argv = [self.cli, "run", "--detach", "--name", self.name, "--init"]
        argv += ["--network", "bridge" if self.network else "none", "--cap-drop", "NET_RAW"]
        argv += ["--security-opt", "no-new-privileges"]
        argv += ["--memory", str(limits.memory_bytes), "--memory-swap", str(limits.memory_bytes)]
        argv += ["--pids-limit", str(limits.max_processes), "--cpus", f"{self.cpus:g}"]
        argv += ["--tmpfs", f"/tmp:rw,exec,size={limits.tmp_bytes}"]
        argv += ["--label", "tslightning.attempt=1", "--entrypoint", "sleep", self.image, "infinity"]
        _RUNNING.add(self)
        self.started = True
        try:
            self._engine(*argv[1:])
            if self.start_command:
                start = ["exec", "--detach", "--workdir", self.workdir, self.name, "/bin/sh", "-c", self.start_command]
                self._engine(*start)
        except BaseException:
            self.close()
            raise

    def _compose_files(self) -> tuple[Path, Path]:
        return self.compose_file, self.attempt.root / ".tsl-compose-override.json"

    def _start_compose(self, limits: SandboxLimits) -> None:
        """Start every service of the task's compose file, ``main`` overridden (see :mod:`compose`)."""
        if not compose_available(self.cli):
            raise SandboxUnavailableError(
                f"task needs helper containers ({self.compose_file.name}), and `{self.cli} compose` is not available:"
                " install the compose plugin, or leave the task out (tasks validate: needs helper container)"
            )
        files = self._compose_files()
        files[1].write_text(compose_override(self.name, self.image, limits, self.cpus, self.network))
        _RUNNING.add(self)
        self.started = True
        try:
            up = compose_argv(self.cli, self.name, files, "up", "--detach", "--wait")[1:]
            self._engine(*up, env=self.compose_env, timeout_s=self.compose_timeout_s)
            if self.start_command:
                start = ["exec", "--detach", "--workdir", self.workdir, self.name, "/bin/sh", "-c", self.start_command]
                self._engine(*start)
        except BaseException:
            self.close()
            raise

    def copy_into(self, source: str, inside: str) -> None:
        """Copy the host directory ``source``'s contents to ``inside`` in the container (a step's files)."""
        if not self.started:
            self._start(self.limits)
        self._engine("exec", self.name, "mkdir", "-p", inside)
        self._engine("cp", f"{source}/.", f"{self.name}:{inside}")

    def _copy_in(self, mount: Mount) -> None:
        inside = MOUNT_POINTS[mount]
        self._engine("exec", self.name, "rm", "-rf", inside)
        self._engine("cp", f"{self.attempt.host_path(mount)}/.", f"{self.name}:{inside}")

    def _copy_out(self, mount: Mount) -> None:
        target = self.attempt.host_path(mount)
        self._engine("cp", f"{self.name}:{MOUNT_POINTS[mount]}/.", str(target))

    def _kill_command(self, pid_file: str) -> None:
        with contextlib.suppress(SandboxError):
            script = f'p=$(cat {pid_file}) && pkill -KILL -P "$p"; kill -KILL "$p"'
            self._engine("exec", self.name, "sh", "-c", script)

    def _engine(self, *arguments: str, env: dict[str, str] | None = None, timeout_s: float = CONTROL_TIMEOUT_S) -> str:
        """Run one engine command (with ``env`` added to the trainer's environment); its stdout. Raises SandboxError
        naming the call and the engine's message."""
        environment = {**os.environ, **env} if env else None
        try:
            done = subprocess.run(
                [self.cli, *arguments], capture_output=True, text=True, timeout=timeout_s, check=False, env=environment
            )
        except (OSError, subprocess.SubprocessError) as error:
            raise SandboxError(f"{self.cli} {arguments[0]} failed: {error}") from error
        if done.returncode != 0:
            raise SandboxError(f"{self.cli} {' '.join(arguments[:2])} failed: {done.stderr.strip()[-500:]}")
        return done.stdout

    def close(self) -> None:
        """Remove the attempt's container (``rm -f``, whatever runs in it; a compose project: ``down``);
        idempotent."""
        if not self.started:
            return
        self.started = False
        _RUNNING.discard(self)
        argv = [self.cli, "rm", "-f", self.name]
        if self.compose_file is not None:
            down = ("down", "--volumes", "--remove-orphans", "--timeout", "0")
            argv = compose_argv(self.cli, self.name, self._compose_files(), *down)
        environment = {**os.environ, **self.compose_env} if self.compose_env else None
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(argv, capture_output=True, timeout=CONTROL_TIMEOUT_S, env=environment)


def engine_environment() -> dict[str, str]:
    """The trainer's variables that tell the CLI where its engine is (``DOCKER_HOST``, ``XDG_RUNTIME_DIR`` for
    rootless podman, ...): the ``exec`` client gets these, never anything else of the trainer's environment."""
    return {
        name: value
        for name, value in os.environ.items()
        if name.startswith(_ENGINE_PREFIXES) or name in ("HOME", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME")
    }


def engine_cli(engine: str) -> str:
    """The CLI of ``engine`` (``docker`` / ``podman``), checked with ``info``.

    Raises:
        SandboxUnavailableError: missing CLI, or no engine answers (the message names the fix).
    """
    cli = shutil.which(engine)
    if cli is None:
        raise SandboxUnavailableError(
            f"sandbox.backend={engine!r} needs the {engine} CLI and a running engine; {engine} is not on PATH. "
            "Install it, or choose sandbox.backend='bubblewrap' (apt-get install bubblewrap)."
        )
    try:
        probe = subprocess.run([cli, "info"], capture_output=True, text=True, timeout=CONTROL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as error:
        raise SandboxUnavailableError(f"sandbox.backend={engine!r}: `{engine} info` did not answer: {error}") from error
    if probe.returncode != 0:
        detail = (probe.stderr or probe.stdout).strip().splitlines()
        raise SandboxUnavailableError(
            f"sandbox.backend={engine!r} needs a running engine, but `{engine} info` failed"
            f"{': ' + detail[-1] if detail else ''}. Start it, or choose sandbox.backend='bubblewrap'."
        )
    return cli


@atexit.register
def _remove_running() -> None:
    """At the trainer's exit, remove every attempt container still running."""
    for sandbox in list(_RUNNING):
        sandbox.close()
