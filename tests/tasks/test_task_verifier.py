"""Running a task's verifier in the sandbox, and an agent's attempt at a terminal task."""

from __future__ import annotations

import shutil

import pytest

from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import library_dir, sandbox_factory
from tslightning.tasks.verifier import run_reference_solution, run_verifier


def _task_with_verifier(tmp_path, test_sh, toml="[verifier]\ntimeout_sec = 20\n"):
    root = tmp_path / "probe"
    (root / "environment").mkdir(parents=True)
    (root / "environment" / "input.txt").write_text("hello\n")
    (root / "tests").mkdir()
    (root / "tests" / "test.sh").write_text("#!/bin/bash\n" + test_sh)
    (root / "instruction.md").write_text("Probe.\n")
    (root / "task.toml").write_text(toml)
    return TerminalTask.load(root)


def _verify(task, scheme="seta"):
    with task.open_attempt() as attempt:
        return run_verifier(task, sandbox_factory()(attempt), scheme)


def test_counts_become_seta_or_binary_reward(tmp_path):
    task = _task_with_verifier(
        tmp_path, 'echo checking; echo \'{"tests_passed": 3, "tests_total": 4}\' > /logs/verifier/reward.json\n'
    )
    seta, binary = _verify(task), _verify(task, "binary")
    assert seta.reward == 0.75 and seta.passed_fraction == 0.75 and not seta.passed
    assert seta.reason == "3/4 tests passed (reward.json)" and "checking" in seta.output and seta.exit_code == 0
    assert binary.reward == 0.0 and binary.passed_fraction == 0.75


def test_full_pass_from_reward_txt(tmp_path):
    result = _verify(_task_with_verifier(tmp_path, "echo 1 > /logs/verifier/reward.txt\n"))
    assert result.passed and result.reward == 1.5 and result.reason == "pass fraction 1 (reward.txt)"


def test_verifier_sees_app_and_tests_but_runs_with_its_env(tmp_path):
    test_sh = (
        'test "$(cat /app/input.txt)" = hello && test -f /tests/test.sh && test "$MODE" = strict '
        "&& echo 1 > /logs/verifier/reward.txt\n"
    )
    task = _task_with_verifier(tmp_path, test_sh, '[verifier]\ntimeout_sec = 20\nenv = { MODE = "strict" }\n')
    assert _verify(task).passed


def test_malformed_and_missing_reward_files_score_zero_with_a_reason(tmp_path):
    malformed = _verify(_task_with_verifier(tmp_path / "a", "echo great > /logs/verifier/reward.txt\nexit 3\n"))
    assert malformed.reward == 0.0 and malformed.passed_fraction is None
    assert malformed.reason == "reward.txt must hold one number in [0, 1]; got 'great' (verifier exit code 3); reward 0"
    missing = _verify(_task_with_verifier(tmp_path / "b", "echo oops >&2; exit 1\n"))
    assert missing.reward == 0.0 and "wrote neither reward.json nor reward.txt" in missing.reason
    assert "oops" in missing.output_tail()


def test_verifier_timeout_scores_zero(tmp_path):
    slow = "echo 1 > /logs/verifier/reward.txt\nsleep 30\n"
    task = _task_with_verifier(tmp_path, slow, "[verifier]\ntimeout_sec = 1\n")
    result = _verify(task)
    assert result.timed_out and result.reward == 0.0 and result.passed_fraction is None
    assert result.reason.startswith("verifier timed out after 1 s")


def test_agent_attempt_cannot_see_tests_and_is_scored_by_the_verifier():
    task = TerminalTask.load(library_dir() / "count-lines")
    with TerminalTaskAttempt(task) as attempt:
        hidden = attempt.run_command("ls /tests /oracle /logs/verifier")
        assert hidden.exit_code != 0 and "No such file" in hidden.output
        assert attempt.run_command("wc -l < log.txt > count.txt").ok
        assert attempt.verify() == 1.5 and attempt.verification.reason == "4/4 tests passed (reward.json)"
        # The verifier can run again on the same attempt; only that run's reward file counts.
        assert attempt.run_command("echo 5 > count.txt").ok
        assert attempt.verify() == pytest.approx(0.75)
        root = attempt.attempt.root
    assert not root.exists()


def test_agent_command_limits_come_from_the_task():
    task = TerminalTask.load(library_dir() / "count-lines")
    with TerminalTaskAttempt(task, command_timeout_s=1.0) as attempt:
        assert attempt.command_limits.memory_bytes == 1024 * 2**20
        result = attempt.run_command("sleep 5")
        assert result.timed_out and result.limit_hit == "timeout"


def test_reference_solution_needs_solve_sh(tmp_path):
    task = _task_with_verifier(tmp_path, "exit 0\n")
    with task.open_attempt() as attempt, pytest.raises(FileNotFoundError, match="solution/solve.sh"):
        run_reference_solution(task, sandbox_factory()(attempt))


def test_reference_solution_sees_oracle_not_tests(tmp_path):
    source = library_dir() / "count-lines"
    shutil.copytree(source, tmp_path / "count-lines")
    (tmp_path / "count-lines" / "solution" / "solve.sh").write_text("ls /oracle && ls /tests\n")
    task = TerminalTask.load(tmp_path / "count-lines")
    with task.open_attempt() as attempt:
        result = run_reference_solution(task, sandbox_factory()(attempt))
    assert "solve.sh" in result.output and result.exit_code != 0 and "/tests" in result.output
