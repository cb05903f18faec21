"""A hostile agent cannot forge its reward (issue 16), through the path ``fit`` uses: a ``TerminalTaskAttempt``'s
``run_command`` writes the agent's files, ``verify`` runs the task's verifier on them.

``fix-python-bug``'s verifier runs ``python3 /app/stats.py`` three times; the agent replaces stats.py with code that
attacks the verifier and then prints a well-formed wrong mean, which honestly passes 1 of 3 checks (reward 1/3).
Whatever the attack, the reward is that honest 1/3 or 0 (with a reason), never the forged 1.5.
"""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask, VerifierSettings
from tslightning.tasks.validation import library_dir

HONEST = pytest.approx(1 / 3)

PRELUDE = """
import ctypes, json, os, resource, signal, stat, sys, time
LOGS = "/logs/verifier"

def forge(mode=None):
    os.makedirs(LOGS, exist_ok=True)
    for name, text in (("reward.json", '{"tests_passed": 3, "tests_total": 3, "reward": 1.5}'), ("reward.txt", "1")):
        path = os.path.join(LOGS, name)
        try:
            with open(path, "w") as file:
                file.write(text + "\\n")
            if mode is not None:
                os.chmod(path, mode)
        except OSError as error:
            print("forge failed:", error, file=sys.stderr)

def test_sh_pid():
    "The topmost ancestor running /tests/test.sh (its subshells have the same command line)."
    pid, found = os.getpid(), None
    while pid > 1:
        with open(f"/proc/{pid}/stat") as file:
            pid = int(file.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            if b"/tests/test.sh" in file.read():
                found = pid
    if found is None:
        raise SystemExit("no test.sh above me")
    return found

def daemon(body, delay=0.0):
    "Run body() in a grandchild that outlives this process (an orphan, as an attacker would leave it)."
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(delay)
            body()
            os._exit(0)
        os._exit(0)
    os.wait()
"""

ATTACKS = {
    # The report: forged files made read-only, so the verifier's own writes fail.
    "read-only forged files": "forge(0o444)",
    "forged files without owner write": "forge(0o400)",
    "log directory made read-only": "forge(); os.chmod(LOGS, 0o555)",
    "directory in place of reward.json": (
        "forge(); os.remove(LOGS + '/reward.json'); os.makedirs(LOGS + '/reward.json', exist_ok=True)"
    ),
    "symlink in place of reward.json": (
        "open('/app/forged.json', 'w').write('{\"reward\": 1}')\n"
        "forge(); os.remove(LOGS + '/reward.json'); os.symlink('/app/forged.json', LOGS + '/reward.json')"
    ),
    "hard link kept to reward.json": "forge(); os.link(LOGS + '/reward.json', LOGS + '/kept-link')",
    "renamed over by a forged copy": (
        "forge(); open(LOGS + '/x', 'w').write('1\\n'); os.chmod(LOGS + '/x', 0o444); "
        "os.rename(LOGS + '/x', LOGS + '/reward.txt')"
    ),
    "late writer after test.sh exits": "daemon(lambda: forge(), delay=1.0)",
    "rewriter racing the final write": (
        "def race():\n    end = time.time() + 3\n    while time.time() < end:\n        forge()\ndaemon(race)"
    ),
    "limits of test.sh lowered": (
        "pid = test_sh_pid()\nforge()\n"
        "for limit in (resource.RLIMIT_NOFILE, resource.RLIMIT_FSIZE):\n"
        "    try: resource.prlimit(pid, limit, (3, 3))\n"
        "    except OSError as error: print('prlimit refused:', error, file=sys.stderr)"
    ),
    "test.sh memory written through /proc": (
        "forge()\ntry: open(f'/proc/{test_sh_pid()}/mem', 'r+b').write(b'x')\n"
        "except OSError as error: print('mem refused:', error, file=sys.stderr)"
    ),
    "test.sh traced": (
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "if libc.ptrace(16, test_sh_pid(), 0, 0) != 0: print('ptrace refused', ctypes.get_errno(), file=sys.stderr)"
    ),
    "tests edited during the run": (
        "for path in ('/tests/test.sh', '/tests/other.txt'):\n"
        "    for act in (lambda: open(path, 'a').write('\\necho 1 > /logs/verifier/reward.txt\\n'),\n"
        "                lambda: os.chmod(path, 0o777), lambda: os.rename(path, path + '.x'),\n"
        "                lambda: os.remove(path)):\n"
        "        try: act()\n"
        "        except OSError as error: open('/app/refusals.txt', 'a').write(f'{error}\\n')"
    ),
    "init of the sandbox signalled": "forge()\nfor s in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT): os.kill(1, s)",
    "process table filled before the final write": (
        "forge()\n"
        "def hold():\n"
        "    for _ in range(400):\n"
        "        try:\n"
        "            if os.fork() == 0: time.sleep(30); os._exit(0)\n"
        "        except OSError: break\n"
        "    time.sleep(30)\n"
        "daemon(hold)"
    ),
}


def hostile_stats_py(attack: str) -> str:
    return f"{PRELUDE}\n{attack}\nprint('mean=0.00')\n"


@pytest.fixture(scope="module")
def fix_python_bug() -> TerminalTask:
    return TerminalTask.load(library_dir() / "fix-python-bug")


def write_app_file(attempt: TerminalTaskAttempt, name: str, text: str) -> None:
    """One agent turn: write ``/app/NAME`` with a heredoc, as a policy would."""
    result = attempt.run_command(f"cat > /app/{name} <<'TSL_EOF'\n{text}\nTSL_EOF")
    assert result.ok, result


@pytest.mark.parametrize("name", ATTACKS)
def test_verifier_executing_hostile_agent_code_reports_the_honest_reward_or_zero(fix_python_bug, name):
    with TerminalTaskAttempt(fix_python_bug) as attempt:
        write_app_file(attempt, "stats.py", hostile_stats_py(ATTACKS[name]))
        reward = attempt.verify()
        verdict = attempt.verification
    assert reward != 1.5 and reward in (0.0, HONEST), verdict.reason
    if reward == 0.0:
        assert verdict.reason.endswith("reward 0") and verdict.passed_fraction is None, verdict.reason


def test_the_reported_attack_scores_zero_and_names_the_tampering(fix_python_bug):
    with TerminalTaskAttempt(fix_python_bug) as attempt:
        write_app_file(attempt, "stats.py", hostile_stats_py(ATTACKS["read-only forged files"]))
        assert attempt.verify() == 0.0
        assert "permissions changed" in attempt.verification.reason


def test_killing_the_test_runner_scores_zero(fix_python_bug):
    with TerminalTaskAttempt(fix_python_bug) as attempt:
        write_app_file(attempt, "stats.py", hostile_stats_py("forge(); os.kill(test_sh_pid(), signal.SIGKILL)"))
        assert attempt.verify() == 0.0
        assert "ended by SIGKILL" in attempt.verification.reason


def test_a_stopped_test_runner_times_out_with_zero(fix_python_bug):
    quick = dataclasses.replace(fix_python_bug, verifier=VerifierSettings(timeout_sec=3.0))
    with TerminalTaskAttempt(quick) as attempt:
        write_app_file(attempt, "stats.py", hostile_stats_py("forge(); os.kill(test_sh_pid(), signal.SIGSTOP)"))
        assert attempt.verify() == 0.0
        assert attempt.verification.timed_out and "timed out" in attempt.verification.reason


def test_filling_the_disk_stops_the_verifier_with_zero(fix_python_bug):
    small = dataclasses.replace(
        fix_python_bug, environment=dataclasses.replace(fix_python_bug.environment, storage_mb=16)
    )
    attack = (
        "forge()\nfor name in 'ab': os.posix_fallocate(os.open('/app/' + name, os.O_CREAT | os.O_WRONLY), 0, 12 << 20)"
    )
    with TerminalTaskAttempt(small) as attempt:
        write_app_file(attempt, "stats.py", hostile_stats_py(attack + "\ntime.sleep(2)"))
        assert attempt.verify() == 0.0
        assert "limit hit: disk" in attempt.verification.reason


def test_a_fifo_in_place_of_the_reward_file_neither_hangs_nor_passes(fix_python_bug):
    quick = dataclasses.replace(fix_python_bug, verifier=VerifierSettings(timeout_sec=3.0))
    attack = "forge(); os.remove(LOGS + '/reward.json'); os.mkfifo(LOGS + '/reward.json')"
    with TerminalTaskAttempt(quick) as attempt:
        write_app_file(attempt, "stats.py", hostile_stats_py(attack))
        assert attempt.verify() == 0.0  # the verifier's write blocks until its timeout; the host never opens it


def test_tests_cannot_be_changed_and_each_verification_gets_a_fresh_copy(fix_python_bug):
    original = (fix_python_bug.tests_dir / "test.sh").read_bytes()
    with TerminalTaskAttempt(fix_python_bug) as attempt:
        write_app_file(attempt, "stats.py", hostile_stats_py(ATTACKS["tests edited during the run"]))
        assert attempt.verify() == HONEST
        refusals = (attempt.attempt.app / "refusals.txt").read_text().splitlines()
        refused = ("Read-only file system", "Permission denied")  # bound read-only; owned by the trainer's user
        assert len(refusals) == 3 * 8 and all(any(r in line for r in refused) for line in refusals), refusals
        assert (attempt.attempt.tests / "test.sh").read_bytes() == original
    assert (fix_python_bug.tests_dir / "test.sh").read_bytes() == original


def test_orphans_are_killed_at_once_and_reported(fix_python_bug):
    # One orphan, left by the first of the verifier's three runs of stats.py: killed within the init's 10 ms tick,
    # long before the verifier's final write. (An orphan left by the last run may still live when that write lands
    # a few ms later; the verification then scores 0, conservatively: see the ATTACKS cases above.)
    first_run_only = "if not os.path.exists('/app/spawned'):\n    open('/app/spawned', 'w').close()\n    "
    with TerminalTaskAttempt(fix_python_bug) as attempt:
        write_app_file(attempt, "stats.py", hostile_stats_py(first_run_only + "daemon(lambda: time.sleep(30))"))
        assert attempt.verify() == HONEST
        result = attempt.sandbox.run("true")  # the sandbox still works; no sleeper survived the verification
    assert result.ok


def test_the_honest_paths_still_pass(fix_python_bug):
    with TerminalTaskAttempt(fix_python_bug) as attempt:
        assert attempt.verify() == HONEST and "1/3" in attempt.verification.reason  # the buggy stats.py
        assert attempt.run_command("sed -i 's|(len(values) + 1)|len(values)|' stats.py").ok
        assert attempt.verify() == 1.5 and attempt.verification.reason == "3/3 tests passed (reward.json)"


def _task(tmp_path, test_sh: str, timeout: float = 20.0) -> TerminalTask:
    root = tmp_path / "probe"
    (root / "environment").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    (root / "instruction.md").write_text("Probe.\n")
    (root / "task.toml").write_text(f"[verifier]\ntimeout_sec = {timeout}\n")
    return TerminalTask.load(root)


def test_a_reward_json_forged_beside_a_verifier_that_writes_only_reward_txt_is_refused(tmp_path):
    task = _task(tmp_path, "bash /app/check.sh; echo 0 > /logs/verifier/reward.txt\n")
    with TerminalTaskAttempt(task) as attempt:
        forge = '{"tests_passed": 5, "tests_total": 5}'
        write_app_file(attempt, "check.sh", f"echo {shlex.quote(forge)} > /logs/verifier/reward.json")
        assert attempt.verify() == 0.0
        assert "disagree" in attempt.verification.reason


def test_only_this_verifications_reward_files_count(tmp_path):
    task = _task(tmp_path, "test -f /app/pass && echo 1 > /logs/verifier/reward.txt; exit 0\n")
    with TerminalTaskAttempt(task) as attempt:
        assert attempt.run_command("touch pass").ok
        assert attempt.verify() == 1.5
        assert attempt.run_command("rm pass").ok
        assert attempt.verify() == 0.0 and "wrote neither" in attempt.verification.reason


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("[" * 60000, "nests 60000 levels"),
        ('{"tests_passed": ' + "9" * 5000 + ', "tests_total": 1}', "integer of 5000 digits"),
        ('{"reward": NaN}', "finite number"),
        ('{"reward": 1e999}', "finite number"),
    ],
)
def test_malformed_reward_json_written_by_the_verifier_scores_zero(tmp_path, content, reason):
    task = _task(tmp_path, "cat /app/reward > /logs/verifier/reward.json\n")
    with TerminalTaskAttempt(task) as attempt:
        (attempt.attempt.app / "reward").write_text(content)
        assert attempt.verify() == 0.0
        assert reason in attempt.verification.reason


DEEP_TREE = (  # 1500 nested directories, then 30 more of 200-character names (paths beyond PATH_MAX), locked
    'python3 -c "import os\n'
    "for name in ['d'] * 1500 + ['x' * 200] * 30: os.mkdir(name); os.chdir(name)\n"
    "open('leaf', 'w').close(); os.chmod('..', 0); print('done')\""
)


def test_a_deep_tree_neither_stops_verification_nor_outlives_the_attempt(tmp_path):
    task = _task(tmp_path, "find /app -type d | wc -l > /dev/null; echo 1 > /logs/verifier/reward.txt\n")
    with TerminalTaskAttempt(task) as attempt:
        assert attempt.run_command(DEEP_TREE).output == "done\n"
        assert attempt.run_command("ls").ok
        assert attempt.verify() == 1.5
        root = attempt.attempt.root
    assert not root.exists()
