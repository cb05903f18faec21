"""A hostile agent's commands, through the path ``fit`` uses (``TerminalTaskAttempt.run_command``): what the issue 16
battery found open is now closed, and what it found contained stays contained. Each case ends with the trainer
intact: a result comes back (never an exception), and the attempt directory is removed on close.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest

import tslightning
from tslightning.sandbox import AttemptDirectory, BubblewrapSandbox, SandboxLimits
from tslightning.sandbox.syscall_filter import _ABIS
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import library_dir


@pytest.fixture
def attempt():
    with TerminalTaskAttempt(TerminalTask.load(library_dir() / "count-lines"), command_timeout_s=20) as attempt:
        yield attempt


def test_nul_and_unencodable_commands_are_observations(attempt):
    for command in ("printf 'a\0b' > x", "echo \udcff\ud800"):
        result = attempt.run_command(command)
        assert result.exit_code == 2 and "It was not run" in result.output
    assert attempt.run_command("echo still here").output == "still here\n"


def test_a_command_that_locks_app_does_not_lock_out_the_next_one(attempt):
    assert attempt.run_command("chmod 000 /app && echo locked").output == "locked\n"
    assert attempt.run_command("wc -l < log.txt > count.txt").ok  # bwrap could not even enter /app before
    assert attempt.verify() == 1.5


def test_a_140_kb_command_runs(attempt):
    content = "line\n" * 28_000
    result = attempt.run_command(f"cat > big.txt <<'EOF'\n{content}EOF\nwc -l < big.txt")
    assert result.ok and result.output == "28000\n"


def _keyctl(number_name: str):
    libc = ctypes.CDLL(None, use_errno=True)
    return libc, _ABIS[platform.machine()].numbers[number_name]


@pytest.mark.skipif(platform.machine() not in _ABIS, reason="no filter for this machine")
def test_the_trainers_keyring_is_out_of_reach_and_attempts_share_no_keyring(attempt):
    libc, add_key = _keyctl("add_key")
    secret = f"tsl-secret-{uuid.uuid4().hex[:8]}".encode()
    key = libc.syscall(add_key, b"user", secret, b"hunter2", 7, -3)  # into the trainer's session keyring
    if key < 0:
        pytest.skip(f"this machine refuses add_key to the trainer too (errno {ctypes.get_errno()})")
    try:
        read = _keyctl("keyctl")[1]
        probe = (
            "import ctypes; libc = ctypes.CDLL(None, use_errno=True); buf = ctypes.create_string_buffer(64)\n"
            f"print(libc.syscall({read}, 11, {key}, buf, 64), ctypes.get_errno(), buf.value)\n"  # KEYCTL_READ
            f"print(libc.syscall({add_key}, b'user', b'note', b'for attempt B', 13, -4), ctypes.get_errno())\n"
        )
        (attempt.attempt.app / "probe.py").write_text(probe)
        result = attempt.run_command("python3 probe.py; cat /proc/keys 2>&1 | grep -c tsl-secret")
        assert result.output.splitlines() == ["-1 1 b''", "-1 1", "0"], result.output
    finally:
        libc.syscall(_keyctl("keyctl")[1], 3, key)  # KEYCTL_REVOKE


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores")
def test_a_command_cannot_widen_its_cpu_affinity(attempt):
    outcome = {}

    def pinned() -> None:
        os.sched_setaffinity(0, {0})  # the rollout's core; the learner's are the others
        outcome["result"] = attempt.run_command(
            "python3 -c 'import os; print(sorted(os.sched_getaffinity(0)))'; "
            "python3 -c 'import os; os.sched_setaffinity(0, range(os.cpu_count()))' 2>&1 | tail -1; "
            "taskset -cp 0-63 $$ >/dev/null"
        )

    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    lines = outcome["result"].output.splitlines()
    assert lines[0] == "[0]" and lines[1] == "PermissionError: [Errno 1] Operation not permitted", lines
    assert "failed to set pid" in lines[2] and "Operation not permitted" in lines[2], lines


def test_tests_are_read_only_even_when_shown(attempt):
    (attempt.attempt.tests / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    if os.geteuid() == 0:  # owned by the uid that runs it (beside a live environment: the verifier's): only the
        uid = getattr(attempt.sandbox, "verifier_uid", 61000)  # read-only bind stops the writes
        for path in (attempt.attempt.tests, attempt.attempt.tests / "test.sh"):
            os.chown(path, uid, uid)
    result = attempt.sandbox.run("echo forged >> /tests/test.sh; touch /tests/new", mounts=("app", "tests"))
    assert result.exit_code == 1 and result.output.count("Read-only file system") == 2


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_agents_keep_strace_but_verifier_runs_refuse_ptrace(attempt):
    assert attempt.run_command("strace -f -o /dev/null true && echo traced").output == "traced\n"
    refused = attempt.sandbox.run("strace -o /dev/null true", verifier=True)
    assert refused.exit_code != 0 and "Operation not permitted" in refused.output


@pytest.mark.parametrize(
    ("command", "evidence"),
    [
        ("ln /etc/passwd /app/pw", "Invalid cross-device link"),  # a hard link out of /app
        ("ln -s /etc/shadow /app/s && cat /app/s", "Permission denied"),  # resolves inside the sandbox
        ("ls /tests /oracle /logs/verifier", "No such file or directory"),
        ("find / -name solve.sh -o -name test_outputs.py 2>/dev/null | grep -v '^/proc' | head -3; echo none", "none"),
        ("kill -9 -1; echo survived", "survived"),  # only its own processes are in reach
        ("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), 2)\"", "unreachable"),
    ],
)
def test_the_contained_escapes_stay_contained(attempt, command, evidence):
    result = attempt.run_command(command)
    assert evidence in result.output, result.output
    assert not (attempt.attempt.app / "pw").exists() or (attempt.attempt.app / "pw").stat().st_nlink == 1


def test_a_task_directory_under_a_system_path_is_hidden(tmp_path):
    if not os.access("/usr/local/share", os.W_OK):
        pytest.skip("cannot write under /usr/local/share here")
    installed = Path("/usr/local/share") / f"tsl-probe-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(library_dir() / "count-lines", installed / "count-lines")
        installed.chmod(0o755)
        task = TerminalTask.load(installed / "count-lines")
        with TerminalTaskAttempt(task, command_timeout_s=20) as attempt:
            shown = attempt.run_command(f"ls -A {installed}/count-lines; cat {installed}/count-lines/tests/test.sh")
            assert shown.exit_code == 1 and shown.output.startswith("cat: ") and "No such file" in shown.output
            assert attempt.run_command("wc -l < log.txt > count.txt").ok and attempt.verify() == 1.5
    finally:
        shutil.rmtree(installed, ignore_errors=True)


def test_a_non_editable_install_under_usr_does_not_expose_the_shipped_tasks():
    """A copy of the package under /usr/local/lib, imported from there: its task library shows empty inside."""
    if not os.access("/usr/local/lib", os.W_OK):
        pytest.skip("cannot write under /usr/local/lib here")
    site = Path("/usr/local/lib") / f"tsl-site-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copytree(Path(tslightning.__file__).parent, site / "tslightning", ignore=shutil.ignore_patterns("*.pyc"))
        package, library = site / "tslightning", site / "tslightning" / "tasks" / "library"
        program = (
            "from tslightning.sandbox import AttemptDirectory, BubblewrapSandbox\n"
            "import tslightning, sys\n"
            "assert tslightning.__file__.startswith(sys.argv[1]), tslightning.__file__\n"
            "with AttemptDirectory() as attempt:\n"
            f"    result = BubblewrapSandbox(attempt).run('ls -A {package}; cat {library}/count-lines/tests/test.sh')\n"
            "print(result.output, end='')\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", program, str(site)],
            env={**os.environ, "PYTHONPATH": str(site)},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.startswith("cat: ") and "No such file or directory" in done.stdout, done.stdout
    finally:
        shutil.rmtree(site, ignore_errors=True)


def test_attempts_are_removed_whatever_the_agent_left(tmp_path):
    with AttemptDirectory() as directory:
        sandbox = BubblewrapSandbox(directory, limits=SandboxLimits(timeout_s=20))
        nasty = (
            "python3 -c \"import os\nfor _ in range(1200): os.mkdir('d'); os.chdir('d')\" && "
            "mkfifo /app/fifo && ln -s / /app/root-link && ln -s /app /app/loop && mkdir -p /app/a/b && "
            "touch /app/a/b/f && chmod 000 /app/a/b /app/a && chmod 444 /app"
        )
        assert sandbox.run(nasty).ok
        root = directory.root
    assert not root.exists() and Path("/").exists() and os.listdir("/usr")
