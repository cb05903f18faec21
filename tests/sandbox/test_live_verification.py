"""A verifier beside a live environment: it reaches what the agent left running, and nothing the agent left running
reaches it (each attack of the hostile-agent brief, from a background process alive during the whole verification).
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tslightning.sandbox import (
    AttemptDirectory,
    LiveBubblewrapSandbox,
    SandboxLimits,
    host_launcher,
    live_environment,
)
from tslightning.sandbox.errors import SandboxError
from tslightning.sandbox.live_verification import (
    DEFAULT_VERIFIER_UID,
    ENVIRONMENT_LAUNCHER,
    LAUNCHER,
    beside_argv,
    environment_argv,
)
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_tasks" / "loopback-service"
AGENT_UID = 61000
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="a verifier beside the environment needs a root trainer")

WATCHED_VERIFIER = """#!/bin/bash
# Reward 0.25 only if the agent's background process ticked while this verifier ran (it was alive and attacking).
mkdir -p /logs/verifier
ticked() {
    local before
    before=$(wc -l < /app/ticks)
    for _ in $(seq 400); do [ "$(wc -l < /app/ticks)" -gt "$before" ] && return 0; sleep 0.1; done
    return 1
}
if ticked; then reward=0.25; else reward=0.75; fi
echo $reward > /logs/verifier/reward.txt
ls /proc/$$/fd > /tmp/fds && echo "descriptors: $(tr '\\n' ' ' < /tmp/fds)"
ticked && ticked  # the attacker gets at least one whole round after the write
"""

FORGER = r"""cat > /tmp/forge.sh <<'EOF'
while :; do
    date +%s%N >> /app/ticks
    { mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt; } 2>/dev/null && echo direct >> /app/won
    for p in /proc/[0-9]*; do
        for target in root/logs/verifier cwd/../../logs/verifier; do
            echo 1 > "$p/$target/reward.txt" 2>/dev/null && echo "$p/$target" >> /app/won
        done
        for fd in "$p"/fd/*; do
            case "$(readlink "$fd")" in *reward*|*logs*) echo 1 > "$fd" 2>/dev/null && echo "$fd" >> /app/won;; esac
        done
    done
    ls /tests /logs > /app/seen 2>&1
    sleep 0.05
done
EOF
nohup bash /tmp/forge.sh > /dev/null 2>&1 &
"""
"""Writes a reward by every path: directly, through each visible process's root, cwd and descriptors."""

KILLER = r"""cat > /tmp/kill.sh <<'EOF'
while :; do
    kill -9 -1 2>/dev/null
    for p in /proc/[0-9]*; do n=${p#/proc/}; [ "$n" != $$ ] && [ "$n" != 1 ] && kill -STOP "$n" 2>/dev/null; done
    date +%s%N >> /app/ticks
    sleep 0.02
done
EOF
nohup bash /tmp/kill.sh > /dev/null 2>&1 &
"""
"""Signals everything it can see, as fast as it can."""


@pytest.fixture
def attempt(tmp_path):
    with TerminalTaskAttempt(TerminalTask.load(FIXTURE), command_timeout_s=20) as attempt:
        yield attempt


def _watched_tests(tmp_path: Path) -> Path:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text(WATCHED_VERIFIER)
    return tests


def test_the_reference_service_left_running_scores_and_ends_with_the_environment(attempt):
    assert attempt.run_solution().ok
    assert attempt.run_command("echo next command").ok  # the server outlives the command that started it
    assert attempt.verify() == 1.5, attempt.verification.output
    assert not attempt.sandbox.live and attempt.sandbox._keeper is None  # ended after the verifier


def test_without_the_service_the_verifier_scores_zero(attempt):
    assert attempt.run_command("mkdir -p www && echo 'hello from the agent' > www/greeting.txt").ok
    assert attempt.run_command("cd www && timeout 1 python3 -m http.server 8080 --bind 127.0.0.1; true").ok
    assert attempt.verify() == 0.0 and "got: ''" in attempt.verification.output


@root_only
def test_a_background_forger_cannot_write_the_reward(attempt, tmp_path):
    assert attempt.run_command(FORGER).ok
    attempt.verify(tests=_watched_tests(tmp_path))
    verification = attempt.verification
    assert verification.passed_fraction == 0.25, verification.reason  # the verifier's, with the forger alive
    app = attempt.attempt.app
    assert not (app / "won").exists(), (app / "won").read_text()
    assert "No such file or directory" in (app / "seen").read_text()  # /tests and /logs exist only for the verifier
    assert "descriptors: 0 1 2 255 \n" in verification.output  # bash's own, nothing from the environment


@root_only
def test_a_background_killer_cannot_stop_the_verifier(attempt, tmp_path):
    assert attempt.run_command(KILLER).ok
    attempt.verify(tests=_watched_tests(tmp_path))
    assert attempt.verification.passed_fraction == 0.25, attempt.verification.reason


@root_only
def test_the_verifiers_processes_and_logs_are_closed_to_the_agents_uid(attempt, tmp_path):
    """Even knowing the verifier's host pids and its log directory's host path (which the agent cannot see), a
    process under the agent's host uid can neither signal them, nor open their root, nor open the directory."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text(  # runs until the probe below is done (at most 60 s)
        "#!/bin/bash\necho 0.5 > /logs/verifier/reward.txt\n"
        "for _ in $(seq 600); do [ -e /app/probed ] && break; sleep 0.1; done\n"
    )
    verifying = threading.Thread(target=attempt.verify, kwargs={"tests": tests})
    verifying.start()
    try:
        pids = _wait_for_processes_of(DEFAULT_VERIFIER_UID)
        probe = (
            "import os, sys\nlogs, pids = sys.argv[1], sys.argv[2:]\n"
            "for action in [lambda: os.listdir(logs)] + [f for p in pids for f in (lambda p=p: os.kill(int(p), 0),"
            " lambda p=p: os.listdir(f'/proc/{p}/root'), lambda p=p: os.listdir(f'/proc/{p}/cwd'))]:\n"
            "    try:\n        action(); print('reached')\n    except PermissionError:\n        print('refused')\n"
            "    except (ProcessLookupError, FileNotFoundError):\n        print('gone')\n"  # a short-lived one
        )
        argv = ["/usr/bin/python3", "-I", "-c", probe, str(attempt.attempt.logs), *map(str, pids)]
        answers = subprocess.run(argv, user=AGENT_UID, group=AGENT_UID, capture_output=True, text=True, timeout=30)
    finally:
        (attempt.attempt.app / "probed").touch()
        verifying.join(timeout=90)
    answers = answers.stdout.split()
    assert len(answers) == 1 + 3 * len(pids) and "reached" not in answers and answers.count("refused") >= 4, answers
    assert attempt.verification.passed_fraction == 0.5
    logs = os.stat(attempt.attempt.logs)
    assert (logs.st_uid, logs.st_mode & 0o777) == (DEFAULT_VERIFIER_UID, 0o700)


def _wait_for_processes_of(uid: int, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [pid for pid in _host_pids() if _uid_of(pid) == uid]
        if len(pids) >= 2:  # bwrap and the verifier's processes
            return pids
        time.sleep(0.05)
    raise AssertionError(f"no process of uid {uid} appeared")


def _host_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _uid_of(pid: int) -> int | None:
    """The real uid of host process ``pid`` (``/proc/PID`` itself is root's for a non-dumpable process)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Uid:"))
    except (OSError, StopIteration):
        return None


@root_only
def test_an_honest_verifier_owns_the_agents_files_as_the_agent_does():
    with AttemptDirectory() as directory:
        live = LiveBubblewrapSandbox(directory, limits=SandboxLimits(timeout_s=20))
        try:
            live.run("mkdir -p out && echo made > out/file && echo kept > kept.txt && chmod 600 kept.txt")
            verifier = live.run(
                "cat /app/out/file /app/kept.txt; stat -c '%a %u' /app/kept.txt; echo built > /app/out/binary;"
                " touch /logs/verifier/mine",
                mounts=("app", "tests", "logs"),
                verifier=True,
            )
        finally:
            live.close()
        # An owner-only file is readable, its mode unchanged; the verifier's writes in /app are the agent's on disk.
        assert verifier.output == "made\nkept\n600 0\n" and verifier.exit_code == 0, verifier.output
        assert (directory.app / "out" / "binary").stat().st_uid == AGENT_UID
        assert (directory.logs / "mine").stat().st_uid == DEFAULT_VERIFIER_UID
        assert not any(str(directory.root) in line for line in Path("/proc/self/mountinfo").read_text().splitlines())


@root_only
@pytest.mark.parametrize("where", ["hand-over", "launcher"])
def test_a_verifier_that_cannot_start_beside_runs_after_the_environment_ended(where, monkeypatch, tmp_path):
    def refuse(*args):
        raise SandboxError("no idmapped mounts here")

    if where == "hand-over":
        monkeypatch.setattr(live_environment, "hand_over_to_verifier", refuse)
    else:  # the launcher exits before bwrap (a kernel or file system without idmapped mounts)
        failing = tmp_path / "launcher.py"
        failing.write_text("import sys\nsys.exit('tsl-verifier-launcher: could not idmap /app')\n")
        monkeypatch.setattr(host_launcher, "LAUNCHER", failing)
    with AttemptDirectory() as directory:
        live = LiveBubblewrapSandbox(directory, limits=SandboxLimits(timeout_s=20))
        try:
            live.run("sleep 300 &")
            verifier = live.run("ps -e -o comm=", mounts=("app", "tests", "logs"), verifier=True)
        finally:
            live.close()
        assert verifier.exit_code == 0 and "sleep" not in verifier.output and not live.live


def test_the_launcher_enters_the_network_maps_the_agents_files_then_becomes_bwrap():
    argv = beside_argv(61001, 61000, 7, ["/a/app", "/a/image-rw/root"], ["bwrap", "--args", "5"])
    assert argv[1:5] == ["-I", "-S", "-B", str(LAUNCHER)] and argv[-4:] == ["--", "bwrap", "--args", "5"]
    assert argv[5:-4] == ["--net", "7", "--uid", "61001", "--agent-uid", "61000", "--idmap", "/a/app"] + [
        "--idmap",
        "/a/image-rw/root",
    ]
    assert "--net" not in beside_argv(61001, 61000, None, [], ["bwrap"])  # its own network


def test_the_launcher_makes_an_environments_own_network_then_becomes_its_bwrap():
    argv = environment_argv(61000, ["bwrap", "--args", "5"])
    assert argv[1:5] == ["-I", "-S", "-B", str(ENVIRONMENT_LAUNCHER)] and argv[-4:] == ["--", "bwrap", "--args", "5"]
    assert argv[5:-4] == ["--new-net", "1", "--uid", "61000", "--agent-uid", "61000"]  # no idmapped binds


def test_the_verifier_uid_must_differ_from_the_agents():
    with AttemptDirectory() as directory, pytest.raises(ValueError, match="verifier_uid"):
        LiveBubblewrapSandbox(directory, unprivileged_uid=61000, verifier_uid=61000)
