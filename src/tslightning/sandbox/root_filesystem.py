"""A root filesystem a sandbox shows instead of the host's system: a task's environment built as a directory.

The root is shown read-only at ``/`` (shared by every attempt of the task); each attempt gets private, writable
copies of the few directories its commands are expected to write outside ``/app`` and ``/tmp`` (the image's working
directory, ``/root``, ...), bound over the read-only root. The root must hold the mount points the sandbox uses
(:data:`REQUIRED_DIRS`) and a ``python3`` with ``ctypes`` for the sandbox's init.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

REQUIRED_DIRS = ("app", "tests", "logs/verifier", "oracle", "run/tslightning/bin", "run/tslightning/tools", "tmp")
"""Directories (relative to the root) where the sandbox mounts things; a read-only root cannot grow them."""
INTERPRETER = "/usr/bin/python3"


@dataclass(frozen=True)
class RootFilesystem:
    """What a sandbox shows at ``/``.

    Attributes:
        path: The root directory on the host (shown read-only).
        writable: Path inside → host directory bound writable over it (the attempt's private copies).
        interpreter: The Python inside the root that runs the sandbox's init.
        files: Path inside → host file bound writable over the root's file there (the attempt's private copy, as
            Docker gives each container its own ``/etc/hosts``).
    """

    path: Path
    writable: Mapping[str, Path] = field(default_factory=dict)
    interpreter: str = INTERPRETER
    files: Mapping[str, Path] = field(default_factory=dict)

    def problems(self) -> list[str]:
        """What is missing for a sandbox to run in this root (each names the path), else empty."""
        found = [f"{self.path}/{name} is missing" for name in REQUIRED_DIRS if not (self.path / name).is_dir()]
        if not (self.path / self.interpreter.lstrip("/")).exists():
            found.append(f"{self.path}{self.interpreter} is missing (the sandbox's init needs python3)")
        for inside, host in self.writable.items():
            if posixpath.normpath(inside) != inside or not inside.startswith("/") or not Path(host).is_dir():
                found.append(f"writable {inside!r} -> {host} is not an absolute path over a host directory")
        for inside, host in self.files.items():
            shown = self.path / inside.lstrip("/")
            if posixpath.normpath(inside) != inside or not inside.startswith("/") or not Path(host).is_file():
                found.append(f"file {inside!r} -> {host} is not an absolute path over a host file")
            elif shown.is_symlink() or not shown.is_file():
                found.append(f"file {inside!r}: {shown} is not a regular file to bind the copy over")
        return found

    def binds(self) -> list[str]:
        """bwrap options: the root read-only, then each writable copy (directories, then files) over it."""
        options = ["--ro-bind", str(self.path), "/"]
        for inside, host in [*sorted(self.writable.items()), *sorted(self.files.items())]:
            options += ["--bind", str(host), inside]
        return options
