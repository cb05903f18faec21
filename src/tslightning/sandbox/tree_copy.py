"""Copies of trusted directory trees (a task's environment, an image's ``/app`` and writable directories) into a new
attempt, made by coreutils' ``cp`` in a process of its own.

An attempt's set-up copies whole trees: a task image's working directory can hold tens of thousands of files. A copy
in Python (``shutil.copytree``) makes several system calls per file from the trainer's process, each one releasing
and retaking the interpreter lock, and set-up runs on threads beside the learner's: while such a copy runs, every
small operator of the learner's thread waits for the lock too. Measured on the image-lite fixture ``corpus-workdir``
(12,050 files, on tmpfs, 2 cores): ``shutil.copytree`` took 1.02 s alone and 1.73 s beside a thread of small torch
operators, whose rate fell from 883 to 406 iterations/s; ``cp`` took 0.54 s and 0.55 s, the thread's rate 879/s.

Only trees the trainer trusts are copied here: ``cp`` follows no symlink of ``source`` (they are copied as symlinks)
and writes into a ``target`` no command of the attempt has touched yet.
"""

from __future__ import annotations

import os
import shutil
import subprocess

COPY_TIMEOUT_S = 600.0
"""Longest a copy may take (a tree of millions of files on a slow disk) before it counts as failed."""


def copy_tree(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Copy the contents of directory ``source`` into ``target`` (created with its missing parents, merged into when
    present): regular files, directories and symlinks (as symlinks), with their modes and times, owned by the caller,
    as ``shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)`` makes them. Without GNU ``cp`` on
    ``PATH`` it is that Python copy.

    Raises:
        OSError: the copy failed or took longer than :data:`COPY_TIMEOUT_S` (the message has ``cp``'s reason).
    """
    source, target = os.fspath(source), os.fspath(target)
    if not os.path.isdir(source):
        raise NotADirectoryError(f"cannot copy {source!r}: not a directory")
    cp = shutil.which("cp")
    if cp is None or not _is_gnu(cp):
        shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        return
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    command = [cp, "--recursive", "--no-dereference", "--preserve=mode,timestamps", "--no-target-directory"]
    try:
        subprocess.run(
            [*command, "--", source, target], check=True, capture_output=True, text=True, timeout=COPY_TIMEOUT_S
        )
    except subprocess.CalledProcessError as error:
        reason = (error.stderr or "").strip().splitlines()
        raise OSError(f"could not copy {source!r} to {target!r}: {reason[0] if reason else error}") from error
    except subprocess.TimeoutExpired as error:
        raise OSError(f"copying {source!r} to {target!r} took over {COPY_TIMEOUT_S:.0f} s") from error


_GNU: dict[str, bool] = {}


def _is_gnu(cp: str) -> bool:
    """Whether ``cp`` is GNU coreutils' (the long options above), asked once per path."""
    if cp not in _GNU:
        try:
            done = subprocess.run([cp, "--version"], capture_output=True, text=True, timeout=30)
            _GNU[cp] = done.returncode == 0 and "GNU coreutils" in done.stdout
        except (OSError, subprocess.TimeoutExpired):
            _GNU[cp] = False
    return _GNU[cp]
