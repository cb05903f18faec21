"""The Dockerfile's ``USER`` in an image-lite environment: who the later ``RUN`` steps, the agent's commands and the
image's ``CMD`` run as, and which files that user owns.

``USER name[:group]`` (or numeric ids) is resolved against the built root's ``/etc/passwd`` and ``/etc/group`` as
Docker resolves it: a name must exist there; a numeric uid need not (its group is then 0, or its passwd entry's);
an unknown name refuses the build at that line.

In an attempt, the sandbox runs as that uid and gid inside its user namespace, where they stand for the sandbox's
one host uid. So the image's files keep their ownership as the user sees it: what the user owned in the image (a
``COPY --chown=app``, what a ``RUN`` after ``USER`` made, the user's home) is the user's in the attempt's private
copies; what root owned stays root's on disk and shows as ``nobody`` (the kernel's name for an owner outside the
namespace), so the user can read it where its mode lets others read, and cannot change it: as in the container,
short of the owner's name.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT_IDS = (0, 0)


def resolve_user(rootfs: Path, spec: str, line: int) -> tuple[int, int]:
    """``(uid, gid)`` of ``USER spec`` in ``rootfs``.

    Raises:
        ValueError: the user or group is not in the image (the Dockerfile line named).
    """
    user, _, group = spec.strip().partition(":")
    entry = _entry(rootfs / "etc/passwd", user)
    if entry is not None:
        uid, primary = int(entry[2]), int(entry[3])
    elif user.isdigit():
        uid, primary = int(user), 0
    else:
        raise ValueError(f"Dockerfile:{line}: USER {spec}: no user {user!r} in the image's /etc/passwd")
    if not group:
        return uid, primary
    if group.isdigit():
        return uid, int(group)
    found = _entry(rootfs / "etc/group", group)
    if found is None:
        raise ValueError(f"Dockerfile:{line}: USER {spec}: no group {group!r} in the image's /etc/group")
    return uid, int(found[2])


def carry_ownership(source: Path, copy: Path, ids: tuple[int, int], host_uid: int) -> None:
    """In ``copy`` (a fresh copy of the image's ``source``, owned by root), give ``host_uid`` what the image's user
    ``ids`` owns in ``source`` (its uid, and its gid, separately), leaving the rest root's; symlinks themselves."""
    uid, gid = ids
    for directory, names, files in os.walk(source):
        relative = Path(directory).relative_to(source)
        for name in (None, *names, *files):
            original = Path(directory) / name if name else Path(directory)
            try:
                found = os.lstat(original)
            except FileNotFoundError:
                continue
            owner = host_uid if found.st_uid == uid else 0
            group = host_uid if found.st_gid == gid else 0
            if (owner, group) != (0, 0):
                os.chown(copy / relative / (name or ""), owner, group, follow_symlinks=False)


def home_of(rootfs: Path, uid: int) -> str:
    """The home directory of ``uid`` in the image's ``/etc/passwd`` (``/`` when it has none, as Docker)."""
    entry = _entry(rootfs / "etc/passwd", str(uid))
    return entry[5] if entry is not None and len(entry) > 5 and entry[5] else "/"


def _entry(table: Path, name: str) -> list[str] | None:
    """The line of ``/etc/passwd`` or ``/etc/group`` for ``name`` (by name, or by id when numeric), split."""
    try:
        lines = table.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split(":")
        if len(fields) > 3 and (fields[0] == name or (name.isdigit() and fields[2] == name)):
            return fields
    return None
