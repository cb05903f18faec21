"""Attempt directories live under a locked per-process parent: removed at exit, and by the next process when killed."""

from __future__ import annotations

import array
import fcntl
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import tslightning.sandbox
from tslightning.sandbox import AttemptDirectory
from tslightning.sandbox.attempt_parent import PREFIX, attempt_parent, remove_stale_parents

OPEN_AND_WAIT = textwrap.dedent(
    """
    import sys, time, types
    package = types.ModuleType("tslightning")  # the sandbox layer alone: not the whole library's imports
    package.__path__ = [sys.argv[2]]
    sys.modules["tslightning"] = package
    from tslightning.sandbox.attempt import AttemptDirectory
    attempt = AttemptDirectory()
    (attempt.app / "work.txt").write_text("left by a killed run")
    print(attempt.root, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(120)
    """
)


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """A private temp directory for this test and the processes it starts (``tempfile`` honours ``TMPDIR``)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def _start(mode: str) -> tuple[subprocess.Popen, Path]:
    package = str(Path(tslightning.sandbox.__file__).parents[1])
    command = [sys.executable, "-c", OPEN_AND_WAIT, mode, package]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    return process, Path(process.stdout.readline().strip())


def test_attempts_share_the_processs_locked_parent_which_others_can_traverse_but_not_list(temp_dir):
    with AttemptDirectory() as first, AttemptDirectory() as second:
        parent = first.root.parent
        assert second.root.parent == parent == attempt_parent() and parent.parent == temp_dir.resolve()
        assert parent.name.startswith(f"{PREFIX}{os.getpid()}-")
        assert stat.S_IMODE(parent.stat().st_mode) == 0o711  # the sandbox's uid passes through, lists nothing
        probe = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(BlockingIOError):  # held by this process as long as it lives
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(probe)
    assert remove_stale_parents(temp_dir) == [] and parent.is_dir()  # a live process's parent stays


def test_a_killed_processs_attempts_are_removed_by_the_next_process_and_a_live_ones_kept(temp_dir):
    killed, killed_attempt = _start("wait")
    alive, alive_attempt = _start("wait")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        assert (killed_attempt / "app" / "work.txt").is_file()  # nothing ran to clean up
        with AttemptDirectory() as attempt:  # the next process's first attempt sweeps
            assert not killed_attempt.parent.exists()
            assert (alive_attempt / "app" / "work.txt").is_file() and attempt.root.is_dir()
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert remove_stale_parents(temp_dir) == [alive_attempt.parent]


def test_a_process_that_exits_leaves_no_attempt_behind_even_one_it_never_closed(temp_dir):
    process, attempt = _start("exit")
    assert process.wait(timeout=30) == 0
    assert attempt.parent.name.startswith(PREFIX) and not attempt.parent.exists()
    assert [path.name for path in temp_dir.iterdir()] == []


def _flags(path: Path) -> int | None:
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(descriptor, 0x80086601, flags, True)  # FS_IOC_GETFLAGS
        return flags[0]
    except OSError:
        return None  # a file system without inode flags (tmpfs)
    finally:
        os.close(descriptor)


def test_on_ext4_the_parent_spreads_its_attempts_over_block_groups(temp_dir):
    """ext4 without a journal scans past recently freed inodes of a group at every allocation: attempts that copy and
    remove thousands of files must not all churn the parent's group (``chattr +T``: Orlov places each apart)."""
    if _flags(temp_dir) is None:
        pytest.skip(f"{temp_dir} has no inode flags (not ext4)")
    assert _flags(attempt_parent()) & 0x00020000  # FS_TOPDIR_FL
