"""Where a process's attempt directories live: one parent directory per process, removed at its exit, and removed
by the next process when it was killed.

A trainer killed by ``SIGKILL`` (an out-of-memory kill, a preempted job, ``kill -9``) runs no clean-up: its attempts'
copies of task environments would stay in the temp directory for ever, run after run, on a node other users share.
So every process puts its attempt directories under one parent of its own, ``<temp dir>/tsl-attempts-<id>``, and
holds an exclusive ``flock`` on it as long as it lives; the kernel releases the lock however the process ends. The
parent is removed when the process exits normally, and the first attempt of any later process (``fit``, ``tasks
validate``, a test session: anything that opens an attempt) removes every such parent of the same user whose lock is
free: its process is gone. Parents of live processes are never touched (their lock is held), nor those of other
users (not ours to remove).

The parent is owned by the trainer, mode ``0711``: the sandbox's uid (and the verifier's) can traverse it to reach
their attempt, as they need to, but not list it, so no agent learns the paths of the other attempts.
"""

from __future__ import annotations

import array
import atexit
import fcntl
import os
import tempfile
import threading
import warnings
from pathlib import Path

from tslightning.sandbox.file_tree import remove_tree

PREFIX = "tsl-attempts-"
"""Name prefix of the per-process parents in the temp directory."""
_MODE = 0o711
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_TOPDIR_FL = 0x80086601, 0x40086602, 0x00020000  # linux/fs.h
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_lock = threading.Lock()
_held: dict[str, tuple[int, int, Path]] = {}
"""Per temp directory: ``(pid, descriptor holding the lock, parent)`` of this process."""


def attempt_parent(base: str | os.PathLike[str] | None = None) -> Path:
    """This process's parent of attempt directories under ``base`` (default: the system temp directory, ``$TMPDIR``
    else ``/tmp``), created (after removing the parents of dead processes) on first use.

    Raises:
        OSError: the parent cannot be created in ``base``.
    """
    base = os.path.realpath(base or tempfile.gettempdir())
    with _lock:
        held = _held.get(base)
        if held is not None and held[0] == os.getpid():
            return held[2]
        remove_stale_parents(base)  # a forked child gets a parent (and a lock) of its own
        descriptor, parent = _create(base)
        _held[base] = (os.getpid(), descriptor, parent)
        return parent


def remove_stale_parents(base: str | os.PathLike[str]) -> list[Path]:
    """Remove every parent in ``base`` of this user whose process is gone (its lock is free); return them. One that
    cannot be removed is warned about, never raised: it blocks no attempt."""
    removed = []
    for path in sorted(Path(base).glob(f"{PREFIX}*")):
        try:
            info = os.lstat(path)
            if info.st_uid != os.geteuid() or not path.is_dir() or path.is_symlink():
                continue
            descriptor = os.open(path, _DIR_FLAGS)
        except OSError:
            continue  # gone meanwhile, or not a directory of ours
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            continue  # its process is alive
        try:
            remove_tree(path)  # under the lock: no other process removes it at the same time
            removed.append(path)
        except OSError as error:
            warnings.warn(f"could not remove the attempt directories of a dead process, {path}: {error}", stacklevel=2)
        finally:
            os.close(descriptor)
    return removed


def _create(base: str) -> tuple[int, Path]:
    """A new parent in ``base``, locked, under its final name only once locked (so no sweep takes it for dead)."""
    staging = Path(tempfile.mkdtemp(prefix=f".{PREFIX}new-", dir=base))
    descriptor = os.open(staging, _DIR_FLAGS)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.chmod(staging, _MODE)
        _spread_children(descriptor)
        parent = staging.with_name(f"{PREFIX}{os.getpid()}-{staging.name.rsplit('-', 1)[-1]}")
        os.rename(staging, parent)
    except BaseException:
        os.close(descriptor)
        os.rmdir(staging)
        raise
    return descriptor, parent


def _spread_children(descriptor: int) -> None:
    """Mark the directory a top of directory hierarchies (``chattr +T``), so ext4's Orlov allocator places each
    attempt in a block group of its own choosing rather than all of them in the parent's.

    Why: ext4 without a journal skips, when it allocates an inode, every free inode of the group freed in the last
    minute (up to six while its inode table is dirty), one buffer-cache lookup each. Attempts that copy thousands of
    files and remove them at close, all in the parent's group, leave it full of such inodes, and every file the next
    attempts create scans past them: set-up then slows down update after update, and in the next run too (measured:
    ``benchmarks/measure_environment_setup.py``). Elsewhere (tmpfs, xfs, btrfs) the flag does not exist: nothing to do.
    """
    flags = array.array("i", [0])
    try:
        fcntl.ioctl(descriptor, _FS_IOC_GETFLAGS, flags, True)
        fcntl.ioctl(descriptor, _FS_IOC_SETFLAGS, array.array("i", [flags[0] | _FS_TOPDIR_FL]), True)
    except OSError:
        pass


@atexit.register
def _remove_own_parents() -> None:
    """At a normal exit: remove this process's parents (and whatever attempts are still in them)."""
    with _lock:
        held = [entry for entry in _held.values() if entry[0] == os.getpid()]
        _held.clear()
    for _, descriptor, parent in held:
        try:
            remove_tree(parent)
        except OSError:
            pass  # the next process's sweep removes the rest
        finally:
            os.close(descriptor)


__all__ = ["PREFIX", "attempt_parent", "remove_stale_parents"]
