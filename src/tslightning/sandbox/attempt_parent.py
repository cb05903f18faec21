"""Where a process's attempt directories live: one parent directory per process, removed at its exit, and removed
by the next process when it was killed.

A trainer killed by ``SIGKILL`` (an out-of-memory kill, a preempted job, ``kill -9``) runs no clean-up: its attempts'
copies of task environments would stay in the temp directory for ever, run after run, on a node other users share.
So every process puts its attempt directories under one parent of its own, ``<base>/tsl-attempts-<id>`` (base:
``$TSLIGHTNING_ATTEMPT_DIR``, else the system temp directory), and holds an exclusive ``flock`` on it as long as it
lives; the kernel releases the lock however the process ends. The parent is removed when the process exits normally,
and the first attempt of any later process (``fit``, ``tasks validate``, a test session: anything that opens an
attempt) removes every such parent of the same user whose lock is free: its process is gone. Parents of live
processes are never touched (their lock is held), nor those of other users (not ours to remove).

The parent is owned by the trainer, mode ``0711``: the sandbox's uid (and the verifier's) can traverse it to reach
their attempt, as they need to, but not list it, so no agent learns the paths of the other attempts.
"""

from __future__ import annotations

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
ATTEMPT_DIR_VARIABLE = "TSLIGHTNING_ATTEMPT_DIR"
"""Environment variable naming the directory attempts are created in (default: the system temp directory)."""
_MODE = 0o711
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_lock = threading.Lock()
_held: dict[str, tuple[int, int, Path]] = {}
"""Per temp directory: ``(pid, descriptor holding the lock, parent)`` of this process."""


def attempt_parent(base: str | os.PathLike[str] | None = None) -> Path:
    """This process's parent of attempt directories under ``base`` (default: :func:`attempts_base`), created (after
    removing the parents of dead processes) on first use.

    Raises:
        OSError: the parent cannot be created in ``base``.
    """
    base = os.path.realpath(base or attempts_base())
    with _lock:
        held = _held.get(base)
        if held is not None and held[0] == os.getpid():
            return held[2]
        remove_stale_parents(base)  # a forked child gets a parent (and a lock) of its own
        descriptor, parent = _create(base)
        _held[base] = (os.getpid(), descriptor, parent)
        return parent


def attempts_base() -> str:
    """Where the per-process parents go: ``$TSLIGHTNING_ATTEMPT_DIR``, else the system temp directory (``$TMPDIR``,
    else ``/tmp``). Every directory above it must be traversable by the sandbox's uid."""
    return os.environ.get(ATTEMPT_DIR_VARIABLE) or tempfile.gettempdir()


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
        parent = staging.with_name(f"{PREFIX}{os.getpid()}-{staging.name.rsplit('-', 1)[-1]}")
        os.rename(staging, parent)
    except BaseException:
        os.close(descriptor)
        os.rmdir(staging)
        raise
    return descriptor, parent


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


__all__ = ["ATTEMPT_DIR_VARIABLE", "PREFIX", "attempt_parent", "attempts_base", "remove_stale_parents"]
