"""The ``Sandbox`` contract every backend fulfils, and what all backends share: environment and limits script."""

from __future__ import annotations

import os
import posixpath
import re
import resource
from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping
from types import MappingProxyType

from tslightning.sandbox.attempt import AttemptDirectory, Mount, validate_mounts
from tslightning.sandbox.errors import SandboxError
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.result import CommandResult
from tslightning.sandbox.supervision import CommandRequest, Launch, supervise

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

    max_command_bytes: int | None = 128 * 1024 - 1
    """Longest command (UTF-8 bytes) the backend can run, None for any length. Backends that pass the command as
    one argument are bound by the kernel's ``MAX_ARG_STRLEN`` (128 KiB); a longer command is not run and its result
    says so."""

    can_share: bool = True
    """Whether :meth:`share` can show a host directory inside (the subprocess backend shows the host as it is)."""

    def __init__(self, attempt: AttemptDirectory, *, limits: SandboxLimits | None = None) -> None:
        self.attempt = attempt
        self.limits = limits if limits is not None else SandboxLimits()
        self.shared: dict[str, str] = {}
        """Host directories shown read-only inside every command: path inside → host path (:meth:`share`)."""

    def share(self, host_dir: str | os.PathLike[str], inside: str) -> None:
        """Show ``host_dir`` read-only at ``inside`` in every later command (a toolchain, a wheel cache).

        Raises:
            ValueError: ``inside`` is not an absolute path under ``/run/`` or ``/opt/``, or ``host_dir`` is not a
                directory.
            SandboxError: this backend cannot show host directories (:attr:`can_share`).
        """
        if not self.can_share:
            raise SandboxError(f"{type(self).__name__} cannot show host directories inside its commands")
        normal = posixpath.normpath(inside)
        if normal != inside or not inside.startswith(("/run/", "/opt/")):
            raise ValueError(f"a shared directory must appear under /run/ or /opt/ (got {inside!r})")
        if not os.path.isdir(host_dir):
            raise ValueError(f"shared directory {os.fspath(host_dir)!r} is not a directory")
        self.shared[inside] = os.path.realpath(host_dir)

    def close(self) -> None:  # noqa: B027 - most backends hold nothing between commands
        """Release what the sandbox holds beyond single commands (a live environment); idempotent."""

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
        """Run ``command`` with ``bash -c`` and return what happened; the command's failures are never raised.

        Whatever the text of ``command`` (an agent's), the result comes back: a command with a NUL character, or
        one that is not encodable, is not run and its result says why (exit status 2, as bash gives a syntax error);
        a command of any length runs (beyond the kernel's 128 KiB argument limit, bash reads it from a descriptor).

        Args:
            command: shell text, as typed in a terminal.
            limits: this run's limits (default: the sandbox's).
            mounts: which of the attempt's directories are visible (``MOUNT_POINTS``): the agent gets ``("app",)``,
                a verifier ``("app", "tests", "logs")``; ``"oracle"`` only for reference solutions. ``/tests`` is
                read-only where the backend can bind it so.
            cwd: absolute working directory inside the sandbox; must exist there (a mount point, or ``/tmp``).
            env: variables added to ``BASE_ENVIRONMENT`` (and overriding it); nothing is inherited from the host.
            verifier: run as a task's verifier, which may execute code the agent wrote: the backend's protections
                of the verifier's own processes apply (``BubblewrapSandbox``: processes orphaned meanwhile are
                killed at once and reported in the result, the shell cannot be traced, ``ptrace`` is refused).

        Raises:
            ValueError: an argument other than ``command``'s text is malformed (the message names it).
            SandboxError: the sandbox could not start the command.
            RuntimeError: the attempt was closed.
        """
        if not isinstance(command, str):
            raise ValueError(f"command must be a str (got {type(command).__name__})")
        if not cwd.startswith("/"):
            raise ValueError(f"cwd must be an absolute path inside the sandbox (got {cwd!r})")
        run_limits = limits if limits is not None else self.limits
        visible = validate_mounts(mounts)
        environment = command_environment(env)
        self.attempt.root  # noqa: B018 - raises when the attempt is closed
        refusal = refuse_unrunnable(command, self.max_command_bytes)
        if refusal is not None:
            return refusal
        return supervise(
            lambda ready_fd: self._launch(
                CommandRequest(command, run_limits, visible, cwd, environment, ready_fd, verifier)
            ),
            run_limits,
        )

    @abstractmethod
    def _launch(self, request: CommandRequest) -> Launch:
        """How to start ``request.command`` in this backend, which applies the kernel limits inside
        (``limits_script``, or the sandbox's init)."""


def refuse_unrunnable(command: str, max_bytes: int | None) -> CommandResult | None:
    """The result of a command no shell can be given (a NUL character, text that is not encodable, or longer than
    ``max_bytes``), else None: exit status 2 and one line saying why and what to do instead."""
    problem = None
    if "\0" in command:
        problem = (
            f"the command contains a NUL character (at character {command.index(chr(0))}), which a shell command "
            "cannot hold; write binary data with printf escapes (printf '\\000')"
        )
    else:
        try:
            size = len(command.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError as error:
            problem = f"the command is not valid text ({error.reason} at character {error.start})"
        else:
            if max_bytes is not None and size > max_bytes:
                problem = f"the command is {size} bytes, more than the {max_bytes} this sandbox runs; split it up"
    if problem is None:
        return None
    return CommandResult(
        exit_code=2,
        output=f"tsl-sandbox: {problem}. It was not run.\n",
        timed_out=False,
        output_truncated=False,
        signal=None,
        limit_hit=None,
        duration_s=0.0,
    )


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


def kernel_limits(limits: SandboxLimits) -> dict[str, tuple[int, int]]:
    """The rlimits (soft, hard) the sandbox's init gives each command, as ``limits_script`` sets them: CPU seconds
    (SIGXCPU at the soft limit, SIGKILL one second later), address space and file size rounded down to KiB,
    processes; each capped at the trainer's own hard limit."""
    cpu_hard = _capped(resource.RLIMIT_CPU, limits.cpu_seconds + 1)
    memory = _capped(resource.RLIMIT_AS, limits.memory_bytes) // 1024 * 1024
    file_size = _capped(resource.RLIMIT_FSIZE, limits.file_size_bytes) // 1024 * 1024
    processes = _capped(resource.RLIMIT_NPROC, limits.max_processes)
    return {
        "cpu": (min(limits.cpu_seconds, cpu_hard), cpu_hard),
        "as": (memory, memory),
        "fsize": (file_size, file_size),
        "nproc": (processes, processes),
    }


def _capped(limit: int, value: int) -> int:
    _, hard = resource.getrlimit(limit)
    return value if hard == resource.RLIM_INFINITY else min(value, hard)
