"""The default backend: each command in fresh bubblewrap namespaces, with only the attempt's directories writable.

What a command sees: the host's ``/usr``, ``/etc`` (and ``/bin``, ``/sbin``, ``/lib*``) read-only, except the
tslightning package and the attempt's ``hidden`` paths (a task's own directory), which show as empty; the requested
attempt directories at ``/app``, ``/logs/verifier``, ``/oracle`` writable and ``/tests`` read-only; a private
``/proc`` (its own processes only), a minimal ``/dev``, private size-bounded ``/tmp`` and ``/dev/shm``; everything
else read-only and empty. It has no network (own loopback only), its own IPC, UTS and cgroup namespaces, no
capabilities, and it cannot create further user namespaces. A seccomp filter (:mod:`syscall_filter`) refuses the
kernel keyrings, CPU-affinity changes and limits on other processes (and, in verifier runs, ``ptrace`` and its
relatives).

Pid 1 of each sandbox is :mod:`init_process` (bwrap ``--as-pid-1``), run with the trainer's Python interpreter: it
starts the command, sums the memory of all its processes and the disk of the attempt (killing the command past
``memory_bytes`` / ``disk_bytes``), kills processes orphaned during verifier runs, and when it exits the kernel
kills whatever is left in the namespace, before ``run`` returns. bwrap's own arguments (the host paths of the
attempt) are passed on a descriptor (``--args``), so they show neither in the host's process list nor in the
sandbox's ``/proc/1/cmdline``; ``/proc/self/mountinfo`` does name the bind mounts' host directories, as the kernel
reports them.

Why the sandbox runs as an unprivileged host uid: the kernel never applies RLIMIT_NPROC to host root, so a fork bomb
run as root would not be contained. When the trainer is root, bwrap is started as ``unprivileged_uid`` and maps it
to uid 0 of a new user namespace: the command still sees itself as root (as in a Docker task image), but holds no
privilege on the host, and the kernel counts its processes in that user namespace, so ``max_processes`` applies per
command rather than being shared by all sandboxes. This needs unprivileged user namespaces (checked at
construction). The attempt's writable directories are handed over to that uid before each run.

No cgroup limits are used: this backend needs no root-only kernel feature and no delegated cgroup (the machines it
was built on have neither cgroup v2 controllers nor delegation); memory and disk are bounded by the init's watch.
"""

from __future__ import annotations

import functools
import marshal
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from tslightning.sandbox.attempt import MOUNT_POINTS, AttemptDirectory, Mount
from tslightning.sandbox.base import BASE_ENVIRONMENT, DEFAULT_PATH, Sandbox, kernel_limits
from tslightning.sandbox.errors import SandboxError, SandboxUnavailableError
from tslightning.sandbox.file_tree import chown_tree
from tslightning.sandbox.host_launcher import environment_argv
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.root_filesystem import RootFilesystem
from tslightning.sandbox.supervision import CommandRequest, Launch
from tslightning.sandbox.syscall_filter import syscall_filter

if TYPE_CHECKING:
    from tslightning.sandbox.attempt_network import AttemptNetwork

DEFAULT_UNPRIVILEGED_UID = 61000
"""Host uid (and gid) of sandboxed commands when the trainer runs as root; unassigned on common distributions."""

RUN_DIR = "/run/tslightning"
"""Where the sandbox's init and its helpers appear inside (read-only copies)."""
GUARDED_BIN = f"{RUN_DIR}/bin"
"""Verifier runs: a copy of bash that cannot be read (mode 0111), first on ``PATH``. A process started from an
unreadable executable is not dumpable, so the verifier's shells cannot be traced nor their memory written through
``/proc/PID/mem`` by the agent's code they run (this machine has no Yama ptrace restriction)."""

BASE_HOME = BASE_ENVIRONMENT["HOME"]
_SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_INIT_FILES = ("init_process.py", "file_tree.py", "session_init.py")
_TMPFS_POINTS = ("/tmp", "/dev/shm")

BWRAP_MISSING = (
    "sandbox.backend='bubblewrap' needs the bwrap binary, which is not on PATH. Install it "
    "(Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), or choose another "
    "sandbox.backend ('docker' with a running engine; 'subprocess' does not isolate)."
)


class BubblewrapSandbox(Sandbox):
    """Runs each command in new bubblewrap namespaces (see the module docstring for what it sees and why).

    Args:
        attempt: the attempt whose directories the commands see.
        limits: the default limits of every ``run``.
        unprivileged_uid: host uid to run as when the trainer is root (ignored otherwise: the trainer's uid is
            already unprivileged).

    Raises:
        SandboxUnavailableError: bwrap is not installed, or cannot create namespaces here, or the trainer's Python
            cannot run inside (the message names the fix).
    """

    max_command_bytes = None  # the init hands a long command to bash on a descriptor
    read_only_mounts: tuple[Mount, ...] = ("tests",)
    """Attempt directories bound read-only."""

    def __init__(
        self,
        attempt: AttemptDirectory,
        *,
        limits: SandboxLimits | None = None,
        unprivileged_uid: int = DEFAULT_UNPRIVILEGED_UID,
    ) -> None:
        super().__init__(attempt, limits=limits)
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailableError(BWRAP_MISSING)
        if unprivileged_uid <= 0:
            raise ValueError(f"unprivileged_uid must be > 0 (got {unprivileged_uid})")
        self._bwrap = bwrap
        self._host_uid = unprivileged_uid if os.geteuid() == 0 else None
        self._handed_over: tuple[int, tuple[Mount, ...], tuple[Mount, ...]] | None = None
        self.root: RootFilesystem | None = None
        self.agent_network = False
        """Agent commands share the host's network (a task that allows the internet, where the trainer allows)."""
        self.verifier_network = False
        """Verifier runs share the host's network."""
        self.identity: tuple[int, int] = (0, 0)
        """``(uid, gid)`` the agent's commands run as inside (an image's ``USER``; verifier runs stay root). Not
        root: ``/app`` keeps the ownership its files were given (the image's), rather than all the sandbox's."""
        self.home: str | None = None
        """``HOME`` of the agent's commands in place of the default ``/tmp`` (the image ``USER``'s home)."""
        self.network: AttemptNetwork | None = None
        """The attempt's shared network (a task with helper services): every command, and a live environment, runs
        in it instead of a network of its own (the trainer is root: it enters it before dropping to the uid)."""
        _check_namespaces(bwrap, self._host_uid)

    def network_for(self, verifier: bool) -> bool:
        """Whether the agent's (or the verifier's) commands share the host's network (:attr:`agent_network`,
        :attr:`verifier_network`; default: neither, their own loopback only)."""
        return self.verifier_network if verifier else self.agent_network

    @property
    def interpreter(self) -> str:
        """The Python that runs the sandbox's init: the root's, or the host's (see :func:`_interpreter`)."""
        return self.root.interpreter if self.root is not None else _interpreter()

    @property
    def host_uid(self) -> int | None:
        """The host uid the sandbox runs as (the trainer is root), else None (the trainer's own)."""
        return self._host_uid

    def use_root(self, root: RootFilesystem, owned: bool = False) -> None:
        """Run every later command in ``root`` instead of the host's system (a task's built environment); its
        writable copies are handed to the sandbox's uid, unless ``owned`` (the caller gave them their owners).

        Raises:
            ValueError: the root lacks what the sandbox needs (the message names each path).
        """
        problems = root.problems()
        if problems:
            raise ValueError(f"root filesystem {root.path} cannot host the sandbox: {'; '.join(problems)}")
        if self._host_uid is not None and not owned:
            for host in root.writable.values():
                chown_tree(Path(host), self._host_uid, self._host_uid)
            for host in root.files.values():
                os.chown(host, self._host_uid, self._host_uid, follow_symlinks=False)
        self.root = root

    def _launch(self, request: CommandRequest) -> Launch:
        self._hand_over_mounts(request.mounts, self.kept_owners(request.verifier))
        _unlock_mount_points(self.attempt, request.mounts)
        if self.network is None or self._host_uid is None:
            return self._bwrap_launch(request)
        launch = self._bwrap_launch(request, joined_network=True)
        netns = os.dup(self.network.fd)  # inheritable; ``supervise`` closes it once started
        argv = environment_argv(self._host_uid, launch.argv, netns)
        return replace(launch, argv=argv, user=None, pass_fds=(*launch.pass_fds, netns))

    def _hand_over_mounts(self, mounts: tuple[Mount, ...], kept: tuple[Mount, ...]) -> None:
        """Hand ``mounts`` to the sandbox's uid (see :func:`_hand_over`; nothing to do when the trainer is not root),
        unless the last hand-over was of the same mounts and the trainer has not written into the attempt since.

        Between two such commands every new file is the sandbox uid's own (commands run as it; a verifier beside a
        live environment writes through idmapped binds as it), so a walk of a large ``/app`` before each command
        (tens of milliseconds of system calls per 10,000 files, holding up the learner's thread) finds nothing.

        Raises:
            SandboxError: the tree changed under the walk (the next command walks again).
        """
        if self._host_uid is None:
            return
        key = (self.attempt.host_writes, tuple(mounts), tuple(kept))
        if key == self._handed_over:
            return
        self._handed_over = None
        _hand_over(self.attempt, mounts, self._host_uid, kept)
        self._handed_over = key

    def agent_env(self, env: Mapping[str, str], verifier: bool = False) -> dict[str, str]:
        """``env`` with :attr:`home` as ``HOME`` for the agent's commands, unless the task set another."""
        if verifier or self.home is None or env.get("HOME", BASE_HOME) != BASE_HOME:
            return dict(env)
        return {**env, "HOME": self.home}

    def kept_owners(self, verifier: bool = False) -> tuple[Mount, ...]:
        """Mounts whose files keep their owners at hand-over: ``/tests`` (read-only), and ``/app`` when the agent
        runs as an image's non-root user (root's files stay root's)."""
        return ("tests", "app") if self.identity != (0, 0) else ("tests",)

    def _bwrap_launch(self, request: CommandRequest, joined_network: bool = False) -> Launch:
        """The launch of one command in fresh namespaces, once its directories are handed over (see ``_options``
        for ``joined_network``)."""
        passed = _Descriptors()
        status_read, status_write = os.pipe()
        passed.fds.append(status_write)
        limits, mounts, verifier = request.limits, request.mounts, request.verifier
        try:
            config = _init_config(request.command, limits, mounts, request.ready_fd, status_write, verifier)
            options = self._options(limits, mounts, request.cwd, request.env, verifier, passed, joined_network)
            init = [self.interpreter, "-I", "-S", "-B", f"{RUN_DIR}/init_process.py", passed.data(config)]
            # bwrap reads its options (with the attempt's host paths) from a descriptor; the command stays in argv.
            options_fd = passed.data(b"".join(os.fsencode(option) + b"\0" for option in options))
        except BaseException:
            passed.close()
            os.close(status_read)
            raise
        return Launch(
            argv=[self._bwrap, "--args", options_fd, "--", *init],
            env={"PATH": DEFAULT_PATH},
            user=self._host_uid,
            pass_fds=tuple(passed.fds),
            status_fd=status_read,
        )

    def _options(
        self,
        limits: SandboxLimits,
        mounts: tuple[Mount, ...],
        cwd: str,
        env: Mapping[str, str],
        verifier: bool,
        passed: _Descriptors,
        joined_network: bool = False,
    ) -> list[str]:
        """bwrap's options: namespaces, binds, masks, filter, the init's files, environment. With
        ``joined_network``, the sandbox stays in the network namespace bwrap is started in (one its launcher
        entered: a live environment's)."""
        namespaces = list(_NAMESPACE_ARGS)
        if not verifier and self.identity != (0, 0):
            namespaces[1:5] = ["--uid", str(self.identity[0]), "--gid", str(self.identity[1])]
        host_network = self.network_for(verifier) and not joined_network
        if host_network or joined_network:
            namespaces.remove("--unshare-net")
        if self.root is not None:  # the init's files go on a tmpfs: a read-only root cannot hold new files
            options = [*namespaces, "--as-pid-1", *self.root.binds(), "--tmpfs", RUN_DIR]
            if host_network and os.path.exists("/etc/resolv.conf"):
                options += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
        else:
            options = [*namespaces, "--as-pid-1", *_system_binds(), *_interpreter_binds()]
        options += _private_dirs(min(limits.tmp_bytes, limits.disk_bytes))
        for mount in mounts:
            bind = "--ro-bind" if mount in self.read_only_mounts else "--bind"
            options += [bind, str(self.attempt.host_path(mount)), MOUNT_POINTS[mount]]
        for inside, host in sorted(self.shared.items()):
            options += ["--ro-bind", host, inside]
        if self.root is None:  # a built root holds none of the host's files
            options += _masks([_PACKAGE_DIR, *self.attempt.hidden])
        options += ["--seccomp", passed.data(syscall_filter(verifier=verifier))]
        for name in _INIT_FILES:
            options += ["--ro-bind-data", passed.data(_init_source(name)), f"{RUN_DIR}/{name}"]
        if verifier:
            options += ["--perms", "0111", "--ro-bind-data", passed.file(_bash()), f"{GUARDED_BIN}/bash"]
        # Read-only from here on: the empty root (no new top-level dirs) and /dev (device nodes stay usable).
        options += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", cwd, "--clearenv"]
        for name, value in _command_env(self.agent_env(env, verifier), verifier).items():
            options += ["--setenv", name, value]
        return options


class _Descriptors:
    """Descriptors handed to bwrap: in-memory files of data, or files opened read-only."""

    def __init__(self) -> None:
        self.fds: list[int] = []

    def data(self, content: bytes) -> str:
        fd = os.memfd_create("tsl-sandbox")  # close-on-exec: only bwrap receives it (pass_fds)
        self.fds.append(fd)
        view = memoryview(content)
        while view:
            view = view[os.write(fd, view) :]
        os.lseek(fd, 0, os.SEEK_SET)
        return str(fd)

    def file(self, path: str) -> str:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self.fds.append(fd)
        return str(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def _init_config(
    command: str, limits: SandboxLimits, mounts: tuple[Mount, ...], ready_fd: int, status_fd: int, verifier: bool
) -> bytes:
    """The configuration :mod:`init_process` reads (``marshal``-encoded)."""
    config = {
        "command": command,
        "shell": f"{GUARDED_BIN}/bash" if verifier else "/bin/bash",
        "rlimits": kernel_limits(limits),
        "ready_fd": ready_fd,
        "status_fd": status_fd,
        "kill_orphans": verifier,
        "memory_bytes": limits.memory_bytes,
        "disk_bytes": limits.disk_bytes,
        "disk_paths": [MOUNT_POINTS[mount] for mount in mounts if mount != "tests"],
        "tmpfs_paths": list(_TMPFS_POINTS),
    }
    return marshal.dumps(config)


def _command_env(env: Mapping[str, str], verifier: bool) -> dict[str, str]:
    if not verifier:
        return dict(env)
    return {**env, "PATH": f"{GUARDED_BIN}:{env.get('PATH', DEFAULT_PATH)}"}


_NAMESPACE_ARGS = (
    "--unshare-user", "--uid", "0", "--gid", "0", "--disable-userns",
    "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
    "--hostname", "sandbox",
    "--die-with-parent",  # if the trainer dies, the sandbox's pid 1 dies, and the kernel kills everything in it
    "--new-session",  # no controlling terminal to inject keystrokes into (TIOCSTI)
)  # fmt: skip


def _system_binds() -> list[str]:
    args: list[str] = []
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


@functools.cache
def _interpreter() -> str:
    """The Python that runs the init inside (it needs the standard library with ``ctypes``, Python >= 3.9): the
    trainer's own when the system binds show it, else the system's ``python3``, else the trainer's with its
    installation bound read-only (the sandbox's uid must be able to read it)."""
    own = os.path.realpath(sys.executable)
    system = shutil.which("python3", path=DEFAULT_PATH)
    for candidate in (own, os.path.realpath(system) if system else None):
        if candidate and _under(candidate, _system_roots()):
            return candidate
    return own


def _interpreter_binds() -> list[str]:
    """The interpreter's installation, read-only at its host path, when it is outside the system directories."""
    if _under(_interpreter(), _system_roots()):
        return []
    prefix = os.path.realpath(sys.base_prefix)
    return ["--ro-bind", prefix, prefix]


@functools.cache
def _system_roots() -> tuple[str, ...]:
    return tuple(os.path.realpath(p) for p in _SYSTEM_PATHS if os.path.exists(p))


def _under(path: str, roots: Iterable[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == root or real.startswith(root + "/") for root in roots)


def _visible(path: str) -> bool:
    """Whether a host path shows inside the sandbox through its read-only binds."""
    binds = _interpreter_binds()
    return _under(path, (*_system_roots(), *binds[1:2]))


def _masks(paths: Iterable[Path]) -> list[str]:
    """An empty read-only tmpfs over each path the binds would show (the package's task library, a task's own
    directory): a non-editable install under ``/usr`` would otherwise expose every task's tests and solution."""
    args: list[str] = []
    for path in sorted({os.path.realpath(p) for p in paths}):
        if os.path.isdir(path) and _visible(path):
            args += ["--tmpfs", path, "--remount-ro", path]
    return args


def _private_dirs(tmp_bytes: int) -> list[str]:
    return [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(tmp_bytes), "--tmpfs", "/dev/shm",
        "--size", str(tmp_bytes), "--tmpfs", "/tmp",
    ]  # fmt: skip


@functools.cache
def _init_source(name: str) -> bytes:
    return (Path(__file__).parent / name).read_bytes()


@functools.cache
def _bash() -> str:
    return os.path.realpath(shutil.which("bash", path=DEFAULT_PATH) or "/bin/bash")


def _hand_over(
    attempt: AttemptDirectory, mounts: tuple[Mount, ...], uid: int, kept: tuple[Mount, ...] = ("tests",)
) -> None:
    """Give ``uid`` ownership of the writable mounted directories (and the attempt root's path down to them), but
    not of the ``kept`` mounts' (their owners were set otherwise).

    Files the host adds to an attempt (the task's environment, a reference solution) are owned by the trainer's
    user; without this the sandbox, running as ``uid``, could read but not write them, unlike in a Docker task
    image. The walk is iterative and descriptor-based and never follows symlinks (:mod:`file_tree`), so neither a
    deep tree nor a directory swapped for a symlink can make this root-owned chown fail or reach host files.
    ``/tests`` is bound read-only and stays the trainer's.

    Raises:
        SandboxError: the tree changed under the walk.
    """
    root = attempt.root
    try:
        for mount in mounts:
            top = attempt.host_path(mount)
            for parent in (root, *(p for p in top.parents if root in p.parents)):
                os.chown(parent, uid, uid, follow_symlinks=False)
            if mount in kept:
                continue
            chown_tree(top, uid, uid)
    except OSError as error:
        raise SandboxError(f"could not hand the attempt's directories to uid {uid}: {error}") from error


def _unlock_mount_points(attempt: AttemptDirectory, mounts: tuple[Mount, ...], also: int = 0) -> None:
    """Give the sandbox's uid (their owner) ``rwx`` on the mounted directories again, and the ``also`` mode bits (a
    verifier beside a live environment: its group's): a command may lock its own ``/app`` (``chmod 000 /app``), and
    bwrap could then not even enter it for the next command."""
    wanted = stat.S_IRWXU | also
    for mount in mounts:
        top = attempt.host_path(mount)
        mode = stat.S_IMODE(os.lstat(top).st_mode)
        if mode & wanted != wanted:
            os.chmod(top, mode | wanted)


@functools.cache
def _check_namespaces(bwrap: str, host_uid: int | None) -> None:
    """Start one trivial sandbox with the namespaces, filter and interpreter ``run`` uses; raise with the fix when
    the kernel refuses, or when the trainer's Python cannot run the init inside."""
    seccomp = os.memfd_create("tsl-probe")
    os.write(seccomp, syscall_filter())
    os.lseek(seccomp, 0, os.SEEK_SET)
    probe = [bwrap, *_NAMESPACE_ARGS, "--as-pid-1", *_system_binds(), *_interpreter_binds(), *_private_dirs(2**20)]
    probe += ["--seccomp", str(seccomp), "--", _interpreter(), "-I", "-S", "-B", "-c", "import ctypes, marshal"]
    try:
        result = subprocess.run(
            probe,
            capture_output=True,
            text=True,
            timeout=30,
            env={"PATH": DEFAULT_PATH},
            user=host_uid,
            group=host_uid,
            extra_groups=[] if host_uid is not None else None,
            pass_fds=(seccomp,),
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise SandboxUnavailableError(f"sandbox.backend='bubblewrap': could not start bwrap: {err}") from err
    finally:
        os.close(seccomp)
    _raise_for_probe(result, host_uid)


def _raise_for_probe(result: subprocess.CompletedProcess, host_uid: int | None) -> None:
    if result.returncode != 0 and "Unknown option" in result.stderr:
        raise SandboxUnavailableError(
            f"sandbox.backend='bubblewrap' needs bwrap >= 0.8.0 (for --disable-userns and --size): "
            f"{result.stderr.strip()}. Install a newer bubblewrap, or choose sandbox.backend='docker'."
        )
    if result.returncode != 0 and result.stderr.startswith("bwrap:"):
        who = f"as uid {host_uid}" if host_uid is not None else "as this user"
        raise SandboxUnavailableError(
            f"sandbox.backend='bubblewrap': bwrap cannot create its namespaces {who}: {result.stderr.strip()}. "
            "It needs unprivileged user namespaces: sysctl user.max_user_namespaces > 0, "
            "kernel.unprivileged_userns_clone=1 (older Debian), kernel.apparmor_restrict_unprivileged_userns=0 "
            "(Ubuntu >= 23.10) or an AppArmor profile for bwrap; inside a container, run it with "
            "--security-opt seccomp=unconfined or choose sandbox.backend='docker' on the host."
        )
    if result.returncode != 0:
        raise SandboxUnavailableError(
            f"sandbox.backend='bubblewrap': the sandbox's init needs the trainer's Python ({_interpreter()}) with "
            f"ctypes inside the sandbox, and it failed there: {result.stderr.strip()[-500:]}. Run the trainer with "
            "a Python whose installation is readable by the sandbox's uid (e.g. the system's /usr/bin/python3)."
        )
