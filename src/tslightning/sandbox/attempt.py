"""One attempt's host directory: the ``/app``, ``/tests``, ``/logs/verifier`` and ``/oracle`` a sandbox shows.

The layout is the one Harbor / Terminal-Bench 2 tasks expect: the agent works in ``/app``; the verifier reads
``/tests``, writes ``/logs/verifier/reward.txt`` (or ``reward.json``); ``/oracle`` holds the reference solution.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Literal

from tslightning.sandbox.attempt_parent import attempt_parent
from tslightning.sandbox.file_tree import remove_tree
from tslightning.sandbox.tree_copy import copy_tree

Mount = Literal["app", "tests", "logs", "oracle"]
"""An attempt directory's mount points: ``/app``, ``/tests``, ``/logs``, ``/oracle``."""

MOUNT_POINTS: MappingProxyType[Mount, str] = MappingProxyType(
    {"app": "/app", "tests": "/tests", "logs": "/logs/verifier", "oracle": "/oracle"}
)
"""Where each part of an attempt appears inside the sandbox."""

_HOST_SUBDIRS: MappingProxyType[Mount, str] = MappingProxyType(
    {"app": "app", "tests": "tests", "logs": "logs/verifier", "oracle": "oracle"}
)


class AttemptDirectory:
    """A fresh host directory for one attempt at a task, removed on ``close`` (or when leaving ``with``).

    Args:
        environment: a task's environment directory; its contents are copied into ``app/`` (symlinks are copied
            as symlinks). None leaves ``app/`` empty.
        parent: where to create the attempt (default: this process's parent in the system temp dir,
            :func:`~tslightning.sandbox.attempt_parent.attempt_parent`, which the next process removes if this one
            is killed). Sandboxes that drop privileges need every directory above it to be traversable by their uid
            (``/tmp`` and that parent are).
        hidden: host directories no command of this attempt may see even where the sandbox shows the host's system
            directories (e.g. the task's own directory, with its tests and reference solution, when it is
            installed under ``/usr``).

    Raises:
        FileNotFoundError: ``environment`` is given and is not a directory.
    """

    def __init__(
        self,
        environment: str | os.PathLike[str] | None = None,
        *,
        parent: str | None = None,
        hidden: Iterable[str | os.PathLike[str]] = (),
    ) -> None:
        if environment is not None and not Path(environment).is_dir():
            raise FileNotFoundError(f"task environment directory {str(environment)!r} does not exist")
        self.hidden: tuple[Path, ...] = tuple(Path(path) for path in hidden)
        self.host_writes = 0
        """How many times the trainer wrote into the attempt's directories (see :meth:`wrote_from_host`)."""
        parent = parent if parent is not None else attempt_parent()
        self._root: Path | None = Path(tempfile.mkdtemp(prefix="tsl-attempt-", dir=parent))
        try:
            for subdir in _HOST_SUBDIRS.values():
                (self._root / subdir).mkdir(parents=True)
            if environment is not None:
                copy_tree(environment, self._root / "app")
        except BaseException:
            self.close()
            raise

    @property
    def root(self) -> Path:
        """The attempt's host directory.

        Raises:
            RuntimeError: the attempt was closed.
        """
        if self._root is None:
            raise RuntimeError("this AttemptDirectory is closed; create a new one for a new attempt")
        return self._root

    @property
    def closed(self) -> bool:
        return self._root is None

    def host_path(self, mount: Mount) -> Path:
        """The host directory shown at ``MOUNT_POINTS[mount]`` inside the sandbox. Code writing there between
        commands calls :meth:`wrote_from_host` (else a root trainer's sandbox may not hand the new files to its
        uid, and the agent cannot change them)."""
        if mount not in _HOST_SUBDIRS:
            raise ValueError(f"unknown mount {mount!r}; choose from {sorted(_HOST_SUBDIRS)}")
        return self.root / _HOST_SUBDIRS[mount]

    @property
    def app(self) -> Path:
        return self.host_path("app")

    @property
    def tests(self) -> Path:
        return self.host_path("tests")

    @property
    def logs(self) -> Path:
        """``logs/verifier``: where the verifier writes ``reward.txt`` / ``reward.json``."""
        return self.host_path("logs")

    @property
    def oracle(self) -> Path:
        return self.host_path("oracle")

    def wrote_from_host(self) -> None:
        """Count a write the trainer made into the attempt's directories after creating them (a step's files, the
        tests, the reference solution): what it wrote is the trainer's until a sandbox hands the directories to its
        uid again, and sandboxes skip that walk while this count is unchanged (the agent's own commands create
        files as that uid already)."""
        self.host_writes += 1

    def close(self) -> None:
        """Remove the attempt's directory and everything in it, whatever the commands left there (unwritable or
        unsearchable directories, trees of any depth, symlinks, FIFOs). Idempotent.

        Raises:
            OSError: something could not be removed (the message names it); the attempt counts as closed anyway.
        """
        if self._root is None:
            return
        root, self._root = self._root, None
        remove_tree(root)

    def __enter__(self) -> AttemptDirectory:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AttemptDirectory({str(self._root) if self._root else 'closed'})"


def validate_mounts(mounts: Iterable[str]) -> tuple[Mount, ...]:
    """The requested mounts, deduplicated in layout order.

    Raises:
        ValueError: a name is not one of ``MOUNT_POINTS`` (a bare string is rejected too: pass ``("app",)``).
    """
    if isinstance(mounts, str):
        raise ValueError(f"mounts must be a collection of names, not the string {mounts!r}; e.g. ('app', 'tests')")
    requested = set(mounts)
    unknown = requested - set(MOUNT_POINTS)
    if unknown:
        raise ValueError(f"unknown mounts {sorted(unknown)}; choose from {list(MOUNT_POINTS)}")
    return tuple(m for m in MOUNT_POINTS if m in requested)
