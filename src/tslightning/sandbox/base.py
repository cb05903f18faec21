"""The ``Sandbox`` contract every backend fulfils, and what all backends share: environment and limits script."""

from __future__ import annotations

import re
import resource
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from types import MappingProxyType

from tslightning.sandbox.attempt import AttemptDirectory, Mount, validate_mounts
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.result import CommandResult
from tslightning.sandbox.supervision import Launch, supervise

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

BASE_ENVIRONMENT: Mapping[str, str] = MappingProxyType(
    {"PATH": DEFAULT_PATH, "HOME": "/tmp", "LANG": "C.UTF-8", "TERM": "dumb"}
)
"""The whole environment of a command, before its explicit ``env``. ``HOME`` is the private ``/tmp`` so that tools'
dotfiles (pip, git, caches) do not land in ``/app``, where the verifier looks."""

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


class Sandbox(ABC):
    """Runs an agent's (or a verifier's) shell commands for one attempt, each under limits, and reports the outcome.

    A sandbox is bound to one ``AttemptDirectory``; each ``run`` is a fresh ``bash -c`` (not a login shell, so the
    host's ``/etc/profile`` cannot override ``PATH``) in its own process tree: files under the attempt's mounts
    persist between runs, processes and ``/tmp`` do not (background jobs are killed when the command returns).

    Args:
        attempt: the attempt whose directories the commands see.
        limits: the default limits of every ``run``.
    """

    def __init__(self, attempt: AttemptDirectory, *, limits: SandboxLimits | None = None) -> None:
        self.attempt = attempt
        self.limits = limits if limits is not None else SandboxLimits()

    def run(
        self,
        command: str,
        *,
        limits: SandboxLimits | None = None,
        mounts: Collection[Mount] = ("app",),
        cwd: str = "/app",
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run ``command`` with ``bash -c`` and return what happened; the command's failures are never raised.

        Args:
            command: shell text, as typed in a terminal.
            limits: this run's limits (default: the sandbox's).
            mounts: which of the attempt's directories are visible (``MOUNT_POINTS``): the agent gets ``("app",)``,
                a verifier ``("app", "tests", "logs")``; ``"oracle"`` only for reference solutions.
            cwd: absolute working directory inside the sandbox; must exist there (a mount point, or ``/tmp``).
            env: variables added to ``BASE_ENVIRONMENT`` (and overriding it); nothing is inherited from the host.

        Raises:
            ValueError: an argument is malformed (the message names it).
            SandboxError: the sandbox could not start the command.
            RuntimeError: the attempt was closed.
        """
        if not isinstance(command, str) or "\0" in command:
            raise ValueError("command must be a str without NUL characters")
        if not cwd.startswith("/"):
            raise ValueError(f"cwd must be an absolute path inside the sandbox (got {cwd!r})")
        run_limits = limits if limits is not None else self.limits
        visible = validate_mounts(mounts)
        environment = command_environment(env)
        self.attempt.root  # noqa: B018 - raises when the attempt is closed
        return supervise(
            lambda ready_fd: self._launch(
                command, limits=run_limits, mounts=visible, cwd=cwd, env=environment, ready_fd=ready_fd
            ),
            run_limits,
        )

    @abstractmethod
    def _launch(
        self,
        command: str,
        *,
        limits: SandboxLimits,
        mounts: tuple[Mount, ...],
        cwd: str,
        env: Mapping[str, str],
        ready_fd: int,
    ) -> Launch:
        """How to start ``command`` in this backend; ``limits_script`` applies the kernel limits inside."""


def command_environment(env: Mapping[str, str] | None) -> dict[str, str]:
    """``BASE_ENVIRONMENT`` updated with ``env``.

    Raises:
        ValueError: a name is not a shell identifier, or a value is not a str or contains NUL.
    """
    environment = dict(BASE_ENVIRONMENT)
    for name, value in (env or {}).items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise ValueError(f"env name {name!r} is not a valid variable name")
        if not isinstance(value, str) or "\0" in value:
            raise ValueError(f"env[{name!r}] must be a str without NUL characters")
        environment[name] = value
    return environment


def limits_script(limits: SandboxLimits, *, ready_fd: int | None, shell: str = "/bin/bash") -> str:
    """Bash text that sets the kernel limits, reports readiness on ``ready_fd``, then runs ``$1`` with ``bash -c``.

    Run it as ``bash -c SCRIPT tsl-sandbox COMMAND``: the command is passed as an argument, never spliced into the
    script, so no quoting is involved. Limits are set inside the sandbox (not in the launcher) so that the process
    limit counts the sandbox's own user namespace (see ``BubblewrapSandbox``), and without ``preexec_fn`` (unsafe
    with threads). Values are capped at the trainer's own hard limits, which an unprivileged child cannot exceed.
    If a limit cannot be set the script exits 126 without reporting readiness.
    """
    cpu_hard = _capped(resource.RLIMIT_CPU, limits.cpu_seconds + 1)
    cpu_soft = min(limits.cpu_seconds, cpu_hard)
    memory_kib = _capped(resource.RLIMIT_AS, limits.memory_bytes) // 1024
    file_kib = _capped(resource.RLIMIT_FSIZE, limits.file_size_bytes) // 1024
    processes = _capped(resource.RLIMIT_NPROC, limits.max_processes)
    # bash's ulimit counts -v and -f in KiB; without -S/-H it sets soft and hard limits together (so -t first sets
    # both to the SIGKILL point, then lowers the soft one to the SIGXCPU point).
    lines = [
        f"ulimit -t {cpu_hard} && ulimit -S -t {cpu_soft} && "
        f"ulimit -v {memory_kib} -f {file_kib} -u {processes} || exit 126",
    ]
    if ready_fd is not None:
        lines.append(f"printf . >&{ready_fd} && exec {ready_fd}>&- || exit 126")
    lines.append(f'exec {shell} -c "$1"')
    return "\n".join(lines)


def _capped(limit: int, value: int) -> int:
    _, hard = resource.getrlimit(limit)
    return value if hard == resource.RLIM_INFINITY else min(value, hard)
