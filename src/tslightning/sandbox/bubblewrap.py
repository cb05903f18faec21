"""The default backend: each command in fresh bubblewrap namespaces, with only the attempt's directories writable.

What a command sees: the host's ``/usr``, ``/etc`` (and ``/bin``, ``/sbin``, ``/lib*``) read-only; the requested
attempt directories at ``/app``, ``/tests``, ``/logs/verifier``, ``/oracle``, writable; a private ``/proc`` (its own
processes only), a minimal ``/dev``, private size-bounded ``/tmp`` and ``/dev/shm``; everything else read-only and
empty. It has no network (own loopback only), its own IPC, UTS and cgroup namespaces, no capabilities, and it cannot
create further user namespaces.

Why the sandbox runs as an unprivileged host uid: the kernel never applies RLIMIT_NPROC to host root, so a fork bomb
run as root would not be contained. When the trainer is root, bwrap is started as ``unprivileged_uid`` and maps it
to uid 0 of a new user namespace: the command still sees itself as root (as in a Docker task image), but holds no
privilege on the host, and the kernel counts its processes in that user namespace, so ``max_processes`` applies per
command rather than being shared by all sandboxes. This needs unprivileged user namespaces (checked at
construction). The attempt's directories are handed over to that uid before each run.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from collections.abc import Mapping

from tslightning.sandbox.attempt import MOUNT_POINTS, AttemptDirectory, Mount
from tslightning.sandbox.base import DEFAULT_PATH, Sandbox, limits_script
from tslightning.sandbox.errors import SandboxUnavailableError
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.supervision import Launch

DEFAULT_UNPRIVILEGED_UID = 61000
"""Host uid (and gid) of sandboxed commands when the trainer runs as root; unassigned on common distributions."""

_SYSTEM_PATHS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

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
        SandboxUnavailableError: bwrap is not installed, or cannot create namespaces here (the message names the
            fix).
    """

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
        _check_namespaces(bwrap, self._host_uid)

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
        if self._host_uid is not None:
            _hand_over(self.attempt, mounts, self._host_uid)
        argv = [self._bwrap, *_NAMESPACE_ARGS, *_system_binds(), *_private_dirs(limits.tmp_bytes)]
        for mount in mounts:
            argv += ["--bind", str(self.attempt.host_path(mount)), MOUNT_POINTS[mount]]
        # Read-only from here on: the empty root (no new top-level dirs) and /dev (device nodes stay usable).
        argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", cwd, "--clearenv"]
        for name, value in env.items():
            argv += ["--setenv", name, value]
        argv += ["--", "/bin/bash", "-c", limits_script(limits, ready_fd=ready_fd), "tsl-sandbox", command]
        return Launch(argv=argv, env={"PATH": DEFAULT_PATH}, user=self._host_uid)


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


def _private_dirs(tmp_bytes: int) -> list[str]:
    return [
        "--proc", "/proc",
        "--dev", "/dev",
        "--size", str(tmp_bytes), "--tmpfs", "/dev/shm",
        "--size", str(tmp_bytes), "--tmpfs", "/tmp",
    ]  # fmt: skip


def _hand_over(attempt: AttemptDirectory, mounts: tuple[Mount, ...], uid: int) -> None:
    """Give ``uid`` ownership of the mounted directories (and their parents up to the attempt root).

    Files the host adds to an attempt (a task's tests, before the verifier runs) are owned by the trainer's user;
    without this the sandbox, running as ``uid``, could read but not write them, unlike in a Docker task image.
    The walk is descriptor-based and never follows symlinks (``os.fwalk``), so a command that swaps a directory for
    a symlink (in a concurrent run on the same attempt) cannot redirect this root-owned chown onto host files.
    """
    root = attempt.root
    for mount in mounts:
        top = attempt.host_path(mount)
        for parent in (root, *(p for p in top.parents if root in p.parents)):
            _own(str(parent), uid)
        for _, dirnames, filenames, dir_fd in os.fwalk(top, follow_symlinks=False):
            _own(".", uid, dir_fd)
            for name in (*dirnames, *filenames):
                _own(name, uid, dir_fd)


def _own(path: str, uid: int, dir_fd: int | None = None) -> None:
    st = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    if st.st_uid != uid or st.st_gid != uid:
        os.chown(path, uid, uid, dir_fd=dir_fd, follow_symlinks=False)


@functools.cache
def _check_namespaces(bwrap: str, host_uid: int | None) -> None:
    """Start one trivial sandbox with the namespaces ``run`` uses; raise with the fix when the kernel refuses."""
    probe = [bwrap, *_NAMESPACE_ARGS, *_system_binds(), *_private_dirs(2**20), "--", "true"]
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
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise SandboxUnavailableError(f"sandbox.backend='bubblewrap': could not start bwrap: {err}") from err
    if result.returncode != 0 and "Unknown option" in result.stderr:
        raise SandboxUnavailableError(
            f"sandbox.backend='bubblewrap' needs bwrap >= 0.8.0 (for --disable-userns and --size): "
            f"{result.stderr.strip()}. Install a newer bubblewrap, or choose sandbox.backend='docker'."
        )
    if result.returncode != 0:
        who = f"as uid {host_uid}" if host_uid is not None else "as this user"
        raise SandboxUnavailableError(
            f"sandbox.backend='bubblewrap': bwrap cannot create its namespaces {who}: {result.stderr.strip()}. "
            "It needs unprivileged user namespaces: sysctl user.max_user_namespaces > 0, "
            "kernel.unprivileged_userns_clone=1 (older Debian), kernel.apparmor_restrict_unprivileged_userns=0 "
            "(Ubuntu >= 23.10) or an AppArmor profile for bwrap; inside a container, run it with "
            "--security-opt seccomp=unconfined or choose sandbox.backend='docker' on the host."
        )
