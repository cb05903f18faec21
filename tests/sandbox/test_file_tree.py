"""Iterative walks over trees an agent wrote: any depth, any path length, locked directories, links not followed."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest

from tslightning.sandbox import file_tree


def _deep_chain(root, names):
    """Create nested directories ``names`` below ``root`` with descriptors (the path exceeds PATH_MAX)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        for name in names:
            os.mkdir(name, dir_fd=fd)
            with open(os.open("f", os.O_WRONLY | os.O_CREAT, dir_fd=fd), "w") as file:
                file.write("x" * 5000)
            child = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def test_remove_tree_handles_depth_beyond_recursion_and_path_max(tmp_path):
    root = tmp_path / "deep"
    root.mkdir()
    _deep_chain(root, ["d"] * 1100 + ["x" * 250] * 20)  # deeper than the recursion limit, longer than PATH_MAX
    with pytest.raises(RecursionError):
        list(os.fwalk(root))  # what the trainer used to do
    assert file_tree.disk_usage(root) > 1120 * 5000
    file_tree.remove_tree(root)
    assert not root.exists()


def test_links_are_removed_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("host data")
    root = tmp_path / "tree"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "to-dir").symlink_to(outside)
    (root / "to-file").symlink_to(outside / "keep.txt")
    os.mkfifo(root / "fifo")
    file_tree.chown_tree(root, 61000, 61000)
    assert outside.stat().st_uid == os.getuid() and (outside / "keep.txt").stat().st_uid == os.getuid()
    assert os.lstat(root / "sub" / "to-dir").st_uid == 61000 and (root / "fifo").stat().st_uid == 61000
    file_tree.remove_tree(root)
    assert not root.exists() and (outside / "keep.txt").read_text() == "host data"


def test_disk_usage_counts_hard_links_once(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 2**20)
    os.link(tmp_path / "a", tmp_path / "b")
    once = file_tree.disk_usage(tmp_path)
    assert 2**20 <= once < 2**20 + 64 * 1024


def test_a_directory_moved_during_the_walk_stops_it(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_text("x")

    def visit(dir_fd, name, entry):
        if name == "f":  # move the directory being walked to elsewhere in the tree
            os.rename(tmp_path / "a" / "b", tmp_path / "moved")
        return True

    with pytest.raises(file_tree.TreeChangedError):
        file_tree.walk_tree(tmp_path / "a", visit)


def test_unlock_walks_unsearchable_directories_and_restores_them(tmp_path):
    locked = tmp_path / "locked"
    (locked / "inner").mkdir(parents=True)
    (locked / "inner" / "data").write_bytes(b"y" * 8192)
    locked.chmod(0)
    seen = []
    file_tree.walk_tree(tmp_path, lambda fd, name, entry: seen.append(name) or True, unlock=True)
    assert {"locked", "inner", "data"} <= set(seen)
    assert stat.S_IMODE(locked.stat().st_mode) == 0
    locked.chmod(0o700)


def test_another_user_removes_what_it_owns_even_locked():
    """Run as an unprivileged uid (no CAP_DAC_OVERRIDE), as the trainer does when it is not root."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a tree owned by another uid")
    tmp_path = Path(tempfile.mkdtemp(prefix="tsl-tree-"))  # under /tmp: every parent traversable by that uid
    root = tmp_path / "tree"
    root.mkdir()
    _deep_chain(root, ["d"] * 1100)
    (root / "locked" / "inner").mkdir(parents=True)
    (root / "locked" / "inner" / "f").write_text("x")
    file_tree.chown_tree(root, 61000, 61000)
    os.chown(tmp_path, 61000, 61000)
    (root / "locked" / "inner").chmod(0)
    (root / "locked").chmod(0o500)
    walker = tmp_path / "file_tree.py"  # stdlib only: runs under the system Python the other uid can read
    walker.write_text(Path(file_tree.__file__).read_text())
    program = "import sys; sys.path.insert(0, sys.argv[1]); import file_tree; file_tree.remove_tree(sys.argv[2])"
    done = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", program, str(tmp_path), str(root)],
        user=61000,
        group=61000,
        extra_groups=[],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert not root.exists()
    file_tree.remove_tree(tmp_path)


def _workdir(tmp_path):
    """The trainer's files to place: a file, a nested file, a symlink."""
    source = tmp_path / "workdir"
    (source / "data").mkdir(parents=True)
    (source / "items.txt").write_text("apples\n")
    (source / "items.txt").chmod(0o640)
    (source / "data" / "rows.csv").write_text("1,2\n")
    (source / "link").symlink_to("items.txt")
    return source


def test_place_tree_replaces_what_the_agent_left_instead_of_writing_through_it(tmp_path):
    source = _workdir(tmp_path)
    victim = tmp_path / "host-file"
    victim.write_text("host's own")
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    app = tmp_path / "app"
    (app / "sub").mkdir(parents=True)
    (app / "sub" / "items.txt").symlink_to(victim)  # a link at a file's name: would overwrite the host file
    (app / "sub" / "data").symlink_to(host_dir)  # a link at a directory's name: would write into the host's
    os.mkfifo(app / "sub" / "link")  # a FIFO: opening it for writing would block
    (app / "sub" / "mine.txt").write_text("agent's")

    file_tree.place_tree(source, app, "sub")

    assert victim.read_text() == "host's own" and not any(host_dir.iterdir())
    placed = app / "sub"
    assert (placed / "items.txt").read_text() == "apples\n" and not (placed / "items.txt").is_symlink()
    assert stat.S_IMODE((placed / "items.txt").stat().st_mode) == 0o640
    assert (placed / "data").is_dir() and not (placed / "data").is_symlink()
    assert (placed / "data" / "rows.csv").read_text() == "1,2\n"
    assert os.readlink(placed / "link") == "items.txt"
    assert (placed / "mine.txt").read_text() == "agent's"  # what the copy does not touch stays


def test_place_tree_refuses_a_directory_in_a_files_place_and_paths_that_leave(tmp_path):
    source = _workdir(tmp_path)
    app = tmp_path / "app"
    (app / "items.txt").mkdir(parents=True)
    with pytest.raises(OSError, match="'items.txt': the attempt has a directory there"):
        file_tree.place_tree(source, app)
    for below in ("../outside", "/etc"):
        with pytest.raises(ValueError, match="not a path below"):
            file_tree.place_tree(source, app, below)
    (app / "gone").symlink_to(tmp_path)  # a link on the way to ``below`` is replaced, not followed
    file_tree.place_tree(source, app, "gone/deeper")
    assert (app / "gone" / "deeper" / "items.txt").is_file() and not (tmp_path / "deeper").exists()
