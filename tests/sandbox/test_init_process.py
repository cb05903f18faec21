"""The sandbox's pid 1: whole-command memory and disk, orphans in verifier runs, any command length, and itself out
of the command's reach. Every case runs a real bubblewrap sandbox."""

from __future__ import annotations

import os
import threading
import time

import pytest

from tslightning.sandbox import AttemptDirectory, BubblewrapSandbox, SandboxLimits

QUICK = SandboxLimits(timeout_s=20)


@pytest.fixture
def sandbox():
    with AttemptDirectory() as attempt:
        yield BubblewrapSandbox(attempt, limits=QUICK)


FORK_AND_HOLD = """
import os, sys, time
for _ in range({children}):
    if os.fork() == 0:
        block = bytearray({megabytes} * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: resident, not just reserved
        time.sleep(30)
        os._exit(0)
    time.sleep(0.2)  # the tree grows child by child: the memory watch samples it, under load too
time.sleep(30)
"""


def test_memory_of_the_whole_process_tree_is_bounded(sandbox):
    """The issue's case: six 100 MB children under memory 160 MB held 633 MB; now the command is killed."""
    (sandbox.attempt.app / "hold.py").write_text(FORK_AND_HOLD.format(children=6, megabytes=100))
    limits = SandboxLimits(timeout_s=20, memory_bytes=160 * 2**20)
    result = sandbox.run("python3 hold.py", limits=limits)
    assert result.limit_hit == "memory" and result.exit_code is None and result.signal == "SIGKILL", result
    assert 160 * 2**20 < result.peak_memory_bytes < 400 * 2**20
    assert result.duration_s < 15 and not result.timed_out


def test_a_command_within_its_memory_runs_and_reports_its_peak(sandbox):
    (sandbox.attempt.app / "hold.py").write_text(FORK_AND_HOLD.format(children=2, megabytes=30).replace("30)", "1)"))
    result = sandbox.run("python3 hold.py", limits=SandboxLimits(timeout_s=20, memory_bytes=300 * 2**20))
    assert result.ok and result.limit_hit is None, result
    assert 60 * 2**20 < result.peak_memory_bytes < 300 * 2**20


def test_disk_of_the_whole_attempt_is_bounded_across_files_and_tmp(sandbox):
    """The issue's case: storage 16 MB stopped one file but 76 MiB were written in total."""
    limits = SandboxLimits(timeout_s=20, file_size_bytes=16 * 2**20, disk_bytes=16 * 2**20)
    spread = "for i in 1 2 3 4 5; do head -c 10M /dev/zero > /app/f$i; done; head -c 10M /dev/zero > /tmp/t; sleep 5"
    result = sandbox.run(spread, limits=limits)
    assert result.limit_hit == "disk" and result.exit_code is None and result.duration_s < 5, result
    assert result.disk_bytes > 16 * 2**20
    # Over the limit, a command that frees space still runs; one that writes more is stopped again.
    assert sandbox.run("head -c 1M /dev/zero > /app/more; sleep 3", limits=limits).limit_hit == "disk"
    freed = sandbox.run("rm -f /app/f* /app/more; echo freed", limits=limits)
    assert freed.ok and freed.output == "freed\n"
    assert sandbox.run("true", limits=limits).disk_bytes < 2**20  # measured as each command starts


def test_tmp_is_sized_by_the_disk_limit(sandbox):
    limits = SandboxLimits(timeout_s=20, disk_bytes=8 * 2**20)
    result = sandbox.run("head -c 20M /dev/zero > /tmp/big; echo $?", limits=limits)
    assert "No space left on device" in result.output


@pytest.mark.parametrize("size", [140_000, 3 * 2**20])
def test_a_command_of_any_length_runs(sandbox, size):
    """Beyond the kernel's 128 KiB per argument (E2BIG before), bash reads the command from a descriptor."""
    command = f"x='{'a' * size}'; echo ${{#x}}"
    result = sandbox.run(command)
    assert result.ok and result.output == f"{size}\n", result.output[-300:]


def test_commands_that_no_shell_can_take_come_back_as_results(sandbox):
    for command, problem in [("echo a\0b", "NUL character (at character 6)"), ("echo \ud800", "not valid text")]:
        result = sandbox.run(command)
        assert result.exit_code == 2 and problem in result.output and "It was not run" in result.output


def test_orphans_live_through_an_agent_command_but_not_a_verifier_run(sandbox):
    orphan = "( (sleep 0.5; echo late) & ); sleep 1.5; echo end"
    agent = sandbox.run(orphan)
    assert agent.output == "late\nend\n" and agent.orphan_count == 0
    verifier = sandbox.run(orphan, verifier=True)
    assert verifier.output == "end\n" and verifier.orphan_count >= 1  # the subshell, then its sleep
    assert verifier.orphans[0].name == "bash" and verifier.last_orphan_death_ns < time.time_ns()
    assert verifier.duration_s < 3


def test_background_jobs_of_the_verifier_itself_are_not_orphans(sandbox):
    """Its direct children seen while it ran; one started in the last tick before it exits counts as an orphan."""
    result = sandbox.run("sleep 30 & sleep 0.3; echo started", verifier=True)
    assert result.ok and result.output == "started\n" and result.orphan_count == 0 and result.duration_s < 5


def test_the_init_cannot_be_signalled_traced_or_read(sandbox):
    result = sandbox.run(
        "kill -KILL 1; kill -TERM 1; kill -INT 1; python3 -c \"open('/proc/1/mem', 'rb')\" 2>&1 | tail -1; echo alive"
    )
    assert result.ok and result.output == "PermissionError: [Errno 13] Permission denied: '/proc/1/mem'\nalive\n"


def test_the_verifier_shell_cannot_be_written_through_proc(sandbox):
    probe = "python3 -c \"import os; open(f'/proc/{os.getppid()}/mem', 'r+b'); print('opened')\" 2>&1 | tail -1; true"
    assert sandbox.run(probe).output == "opened\n"  # an agent command's shell: the agent's own business
    assert "Permission denied" in sandbox.run(probe, verifier=True).output


def test_no_host_path_of_the_attempt_shows_in_any_command_line(sandbox):
    root = str(sandbox.attempt.root)
    found: list[str] = []

    def scan() -> None:
        time.sleep(0.7)
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as file:
                    if root.encode() in file.read():
                        found.append(pid)
            except OSError:
                continue

    scanner = threading.Thread(target=scan)
    scanner.start()
    result = sandbox.run("cat /proc/1/cmdline /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '; sleep 1.5")
    scanner.join()
    assert result.ok and "init_process.py" in result.output and root not in result.output
    assert found == []  # bwrap's own options (the binds of the attempt) are passed on a descriptor


def test_many_empty_files_count_against_the_disk(sandbox):
    """Empty files take no block; each still counts 4 KiB, so an agent cannot pile up millions of entries."""
    limits = SandboxLimits(timeout_s=20, disk_bytes=8 * 2**20)
    # 60,000 entries (seconds of work) against a limit of 2,048: the disk walk (every >= 0.25 s) stops it on the way.
    result = sandbox.run(
        "python3 -c \"[open(f'/app/e{i}', 'w').close() for i in range(60000)]\"; sleep 5", limits=limits
    )
    assert result.limit_hit == "disk" and result.disk_bytes > 8 * 2**20, result
    assert len(os.listdir(sandbox.attempt.app)) < 60000  # stopped on the way
