"""Walks over directory trees that sandboxed commands wrote: iterative, descriptor-relative, never following links.

An agent controls what it leaves in ``/app`` (and a verifier's code in ``/logs/verifier``): a chain of thousands of
nested directories, paths far beyond ``PATH_MAX``, directories without read or search permission, symlinks in
place of directories. ``os.fwalk`` and ``shutil.rmtree`` recurse once per level (``RecursionError`` past ~1000) and
``os.walk`` builds full paths, so every walk here is a loop over an explicit stack that holds at most two open
descriptors: it descends with ``openat(name, O_NOFOLLOW | O_DIRECTORY)`` and climbs back with ``openat("..")``,
checking that ``..`` is the directory it came from (device and inode). Walks assume no command of the attempt runs
meanwhile (the sandbox runs them between commands, or from the sandbox's own init); a tree changed under a walk
raises :class:`TreeChangedError` instead of walking somewhere else.

This module imports only the standard library, and little of it: the sandbox's init process (:mod:`init_process`)
runs it inside the sandbox too, where every import adds to each command's start.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TreeChangedError(OSError):
    """A directory moved while it was being walked; the walk stopped rather than continue elsewhere."""


class _Level:
    """One directory on the walk's stack (a plain class: dataclasses cost the sandbox's init 10 ms of imports)."""

    __slots__ = ("identity", "names", "name", "restore_mode")

    def __init__(
        self, identity: tuple[int, int], names: list[str], name: str | None = None, restore_mode: int | None = None
    ) -> None:
        self.identity = identity
        self.names = names
        self.name = name
        """This directory's name in its parent (None for the root)."""
        self.restore_mode = restore_mode
        """The mode to put back on leaving, when the walk had to make the directory readable."""


Visit = Callable[[int, str, os.stat_result], bool]
"""``visit(dir_fd, name, stat)`` for each entry below the root; returns whether to descend (directories only)."""
Leave = Callable[[int, str, os.stat_result], None]
"""``leave(parent_fd, name, stat)`` after a directory's entries were all visited."""


def walk_tree(
    root: str | os.PathLike[str], visit: Visit, *, leave: Leave | None = None, unlock: bool = False
) -> os.stat_result:
    """Depth-first over everything below ``root`` (not ``root`` itself), with at most two descriptors open.

    Args:
        root: a directory (a symlink is refused with ``OSError`` ELOOP / ENOTDIR).
        visit: called for each entry with the descriptor of its directory; entries vanishing meanwhile are skipped.
        leave: called when a directory was walked, with its parent's descriptor.
        unlock: give directories that cannot be listed or entered owner ``rwx`` for the walk and restore their mode
            afterwards (a walker that owns them but holds no ``CAP_DAC_OVERRIDE``).

    Returns:
        The stat of ``root``.

    Raises:
        TreeChangedError: a directory moved during the walk.
        OSError: ``root`` cannot be opened.
    """
    fd = os.open(root, _DIR_FLAGS)
    try:
        root_stat = os.fstat(fd)
        stack = [_Level((root_stat.st_dev, root_stat.st_ino), os.listdir(fd))]
        while stack:
            level = stack[-1]
            if level.names:
                fd = _step(fd, level, stack, visit, unlock)
                continue
            stack.pop()
            if not stack:
                break
            fd = _climb(fd, stack[-1].identity)
            entry = os.stat(level.name, dir_fd=fd, follow_symlinks=False)
            if level.restore_mode is not None:
                try:
                    os.chmod(level.name, level.restore_mode, dir_fd=fd)
                except OSError:  # best effort: the walk itself is done
                    pass
            if leave is not None:
                leave(fd, level.name, entry)
    finally:
        os.close(fd)
    return root_stat


def _step(fd: int, level: _Level, stack: list[_Level], visit: Visit, unlock: bool) -> int:
    """Visit the next name of ``level``; descend into it when it is a directory the visitor wants."""
    name = level.names.pop()
    try:
        entry = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return fd
    if not visit(fd, name, entry) or not stat.S_ISDIR(entry.st_mode):
        return fd
    opened = _open_dir(fd, name, entry, unlock)
    if opened is None:
        return fd
    child, restore = opened
    try:
        names = os.listdir(child)
    except OSError:
        os.close(child)
        raise
    os.close(fd)
    stack.append(_Level((entry.st_dev, entry.st_ino), names, name, restore))
    return child


def _open_dir(fd: int, name: str, entry: os.stat_result, unlock: bool) -> tuple[int, int | None] | None:
    """Open directory ``name`` below ``fd``: (descriptor, mode to restore), or None when it vanished."""
    restore = None
    try:
        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return None
    except PermissionError:
        if not unlock:
            raise
        restore = stat.S_IMODE(entry.st_mode)
        os.chmod(name, restore | stat.S_IRWXU, dir_fd=fd)  # a directory (lstat above), nothing runs meanwhile
        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    opened = os.fstat(child)
    if (opened.st_dev, opened.st_ino) != (entry.st_dev, entry.st_ino):
        os.close(child)
        raise TreeChangedError(f"directory {name!r} was replaced during the walk")
    return child, restore


def _climb(fd: int, parent: tuple[int, int]) -> int:
    """The descriptor of ``fd``'s parent, which must be ``parent``; ``fd`` is closed once it is."""
    up = os.open("..", _DIR_FLAGS, dir_fd=fd)
    found = os.fstat(up)
    if (found.st_dev, found.st_ino) != parent:
        os.close(up)
        raise TreeChangedError("a directory was moved out of the tree during the walk")
    os.close(fd)
    return up


def remove_tree(root: str | os.PathLike[str]) -> None:
    """Remove ``root`` and everything below it, whatever its depth and permissions (what the walker's user may
    remove: root anything, another user what it owns). Symlinks are removed, never followed.

    Raises:
        OSError: something could not be removed (the message names it).
    """
    root = os.fspath(root)
    if os.path.islink(root) or not os.path.isdir(root):
        os.unlink(root)
        return
    if os.geteuid() != 0:
        os.chmod(root, stat.S_IMODE(os.lstat(root).st_mode) | stat.S_IRWXU)

    def visit(dir_fd: int, name: str, entry: os.stat_result) -> bool:
        if stat.S_ISDIR(entry.st_mode):
            return True
        _writable_retry(dir_fd, lambda: os.unlink(name, dir_fd=dir_fd))
        return False

    def leave(parent_fd: int, name: str, entry: os.stat_result) -> None:
        _writable_retry(parent_fd, lambda: os.rmdir(name, dir_fd=parent_fd))

    walk_tree(root, visit, leave=leave, unlock=True)
    os.rmdir(root)


def _writable_retry(dir_fd: int, remove: Callable[[], None]) -> None:
    """Run ``remove``; when the directory refuses it (no write permission, we own it), make it writable and retry."""
    try:
        remove()
    except PermissionError:
        os.fchmod(dir_fd, stat.S_IMODE(os.fstat(dir_fd).st_mode) | stat.S_IRWXU)
        remove()


def chown_tree(root: str | os.PathLike[str], uid: int, gid: int) -> None:
    """Give ``root`` and everything below it to ``uid``:``gid`` (symlinks themselves, never their targets)."""
    root = os.fspath(root)
    root_fd = os.open(root, _DIR_FLAGS)
    try:
        _own(root_fd, None, os.fstat(root_fd), uid, gid)
    finally:
        os.close(root_fd)

    def visit(dir_fd: int, name: str, entry: os.stat_result) -> bool:
        _own(dir_fd, name, entry, uid, gid)
        return True

    walk_tree(root, visit)


def _own(dir_fd: int, name: str | None, entry: os.stat_result, uid: int, gid: int) -> None:
    if entry.st_uid == uid and entry.st_gid == gid:
        return
    if name is None:
        os.fchown(dir_fd, uid, gid)
    else:
        try:
            os.chown(name, uid, gid, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:  # removed meanwhile: nothing to hand over
            pass


MIN_ENTRY_BYTES = 4096
"""What each file, directory or link counts for at least in :func:`disk_usage` (one block): an empty file takes no
block but an inode and a directory entry, and millions of them would cost every walk (and the trainer's memory)."""


def disk_usage(root: str | os.PathLike[str], *, unlock: bool = False) -> int:
    """Bytes of disk used by ``root`` and everything below it: allocated blocks, at least :data:`MIN_ENTRY_BYTES` per
    entry, each inode counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def visit(dir_fd: int, name: str, entry: os.stat_result) -> bool:
        nonlocal total
        key = (entry.st_dev, entry.st_ino)
        if key not in seen:
            seen.add(key)
            total += max(entry.st_blocks * 512, MIN_ENTRY_BYTES)
        return True

    root_stat = walk_tree(root, visit, unlock=unlock)
    return total + max(root_stat.st_blocks * 512, MIN_ENTRY_BYTES)


def place_tree(source: str | os.PathLike[str], target: str | os.PathLike[str], below: str = ".") -> None:
    """Copy the contents of the trusted directory ``source`` into ``below`` (a relative path, created as needed)
    under ``target``, a directory an attempt's commands write in, without following anything they left there.

    What a command may have put at a path the copy writes to is replaced, not written through: a symlink (to a host
    file the trainer, as root, could otherwise overwrite) or a FIFO (whose opening would block) in place of a file or
    directory is removed first, and every step is descriptor-relative with ``O_NOFOLLOW``, so a link swapped in
    meanwhile fails the copy instead of redirecting it. Files get ``source``'s modes and times; directories that
    exist keep theirs.

    Raises:
        ValueError: ``below`` leaves ``target`` (absolute, or with ``..``).
        OSError: a directory of the attempt's stands where ``source`` has a file, or an entry changed during the
            copy (the message names it).
    """
    parts = [part for part in os.path.normpath(below).split(os.sep) if part not in ("", ".")]
    if os.path.isabs(below) or ".." in parts:
        raise ValueError(f"cannot place files at {below!r}: not a path below {os.fspath(target)!r}")
    source = os.fspath(source)
    for directory, names, files in os.walk(source):  # the trainer's own tree: plain paths are fine
        inside = os.path.relpath(directory, source)
        fd = _open_below(target, [*parts, *(p for p in inside.split(os.sep) if p != ".")])
        try:
            for name in names:
                _place_entry(os.path.join(directory, name), fd, name, is_directory=True)
            for name in files:
                _place_entry(os.path.join(directory, name), fd, name, is_directory=False)
        finally:
            os.close(fd)


def _open_below(target: str | os.PathLike[str], parts: list[str]) -> int:
    """A descriptor of ``target/parts...``, each part a real directory (made when missing or not a directory)."""
    fd = os.open(target, _DIR_FLAGS)
    try:
        for part in parts:
            child = _real_directory(fd, part)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _real_directory(fd: int, name: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        pass
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):  # a symlink; a file or FIFO
            raise
        os.unlink(name, dir_fd=fd)
    os.mkdir(name, 0o755, dir_fd=fd)
    return os.open(name, _DIR_FLAGS, dir_fd=fd)


def _place_entry(path: str, fd: int, name: str, is_directory: bool) -> None:
    """Place ``path`` (a file or symlink of the source; directories are entered by the walk) as ``name`` in ``fd``."""
    info = os.lstat(path)
    if is_directory and not stat.S_ISLNK(info.st_mode):
        os.close(_real_directory(fd, name))
        return
    try:
        os.unlink(name, dir_fd=fd)  # whatever the attempt left there: a file, a link, a FIFO
    except FileNotFoundError:
        pass
    except IsADirectoryError as error:
        raise OSError(f"cannot place {name!r}: the attempt has a directory there") from error
    if stat.S_ISLNK(info.st_mode):
        os.symlink(os.readlink(path), name, dir_fd=fd)
        return
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        out = os.open(name, flags, stat.S_IMODE(info.st_mode), dir_fd=fd)
    except FileExistsError as error:
        raise OSError(f"cannot place {name!r}: something was put there during the copy") from error
    try:
        with open(path, "rb") as data:
            while chunk := data.read(1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
        os.fchmod(out, stat.S_IMODE(info.st_mode))
        os.utime(out, ns=(info.st_atime_ns, info.st_mtime_ns))
    finally:
        os.close(out)
