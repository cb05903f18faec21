"""copy_tree: what shutil.copytree(symlinks=True, dirs_exist_ok=True) would make, made by coreutils' cp."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from tslightning.sandbox import tree_copy
from tslightning.sandbox.tree_copy import copy_tree


def _tree(root):
    """A source with nested directories, modes, times, a symlink that points outside and a dangling one."""
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "data.txt").write_text("payload")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o751)
    (root / "a").chmod(0o705)
    (root / "outside").symlink_to("/etc/hostname")
    (root / "dangling").symlink_to("missing/target")
    os.utime(root / "a" / "b" / "data.txt", (1_000_000, 1_000_000))


def _listing(root):
    """Every entry below ``root``: kind, mode, size, mtime (files), link target (symlinks)."""
    entries = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = os.path.join(directory, name)
            info = os.lstat(path)
            link = os.readlink(path) if stat.S_ISLNK(info.st_mode) else None
            mtime = int(info.st_mtime) if stat.S_ISREG(info.st_mode) else None
            entries[os.path.relpath(path, root)] = (stat.S_IFMT(info.st_mode), stat.S_IMODE(info.st_mode), mtime, link)
    return entries


@pytest.mark.parametrize("gnu", [True, False], ids=["cp", "python"])
def test_copy_equals_shutil_copytree_into_a_new_and_an_existing_target(tmp_path, monkeypatch, gnu):
    if not gnu:
        monkeypatch.setattr(tree_copy.shutil, "which", lambda name: None)
    source = tmp_path / "source"
    source.mkdir()
    _tree(source)
    expected = tmp_path / "expected"
    shutil.copytree(source, expected, symlinks=True, dirs_exist_ok=True)

    fresh = tmp_path / "deep" / "new" / "target"  # missing parents are created
    copy_tree(source, fresh)
    assert _listing(fresh) == _listing(expected)
    assert os.readlink(fresh / "outside") == "/etc/hostname"  # copied as a link, never followed

    existing = tmp_path / "existing"
    (existing / "a").mkdir(parents=True)
    (existing / "kept.txt").write_text("mine")
    copy_tree(source, existing)
    assert (existing / "kept.txt").read_text() == "mine"
    assert (existing / "a" / "b" / "data.txt").read_text() == "payload"


def test_a_failed_copy_says_why_in_one_line(tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "secret").write_text("x")
    target = tmp_path / "target"
    target.mkdir()
    (target / "secret").mkdir()  # a directory where the copy must write a file
    with pytest.raises(OSError, match="could not copy .*secret"):
        copy_tree(source, target)
    with pytest.raises(NotADirectoryError, match="not a directory"):
        copy_tree(tmp_path / "missing", target)
