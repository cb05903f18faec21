"""Multi-step tasks: steps run in order in one environment, each verified with layered tests, min_reward stops early."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.task_steps import run_steps
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import validate_task

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_tasks" / "multi-step-notes"


@pytest.fixture(scope="module")
def task() -> TerminalTask:
    return TerminalTask.load(FIXTURE)


def test_the_multi_step_fixture_loads_its_steps(task):
    assert [step.name for step in task.steps] == ["create", "extend"]
    assert task.instruction == task.step_instruction("create") and task.multi_step
    assert task.steps[0].verifier.timeout_sec == 30.0 and task.steps[1].verifier.timeout_sec == 60.0  # the task's
    assert task.solution_script == FIXTURE / "steps" / "create" / "solution" / "solve.sh"


def test_the_multi_step_fixture_validates(task):
    result = validate_task(FIXTURE)
    assert result.ok, result.problems
    assert result.reference.reward == 1.5 and "create 2/2" in result.reference.reason
    assert "extend 2/2" in result.reference.reason
    # The no-op agent fails the first step, whose min_reward stops the attempt before the second.
    assert result.noop.passed_fraction == 0.0 and "below min_reward 1" in result.noop.reason
    assert "extend" not in result.noop.reason


def test_steps_share_one_environment_and_layer_their_tests(task):
    commands = {"create": "printf '# Notes\\n' > notes.md", "extend": "head -1 items.txt | sed 's/^/- /' >> notes.md"}
    with TerminalTaskAttempt(task) as attempt:
        verdict, outcomes = run_steps(attempt, lambda step, instruction: attempt.run_command(commands[step.name]))
        app = attempt.attempt.app
        assert (app / "items.txt").is_file() and (app / ".extend-ready").is_file() and not (app / "setup.sh").exists()
        assert (app / "notes.md").read_text() == "# Notes\n- apples\n"
    first, second = outcomes
    assert first.verification.passed and not first.note
    # extend has no test.sh of its own: the task's test.sh ran with the step's expected.txt beside it.
    assert second.verification.passed_fraction == 0.5 and second.note == "below min_reward for correctness"
    assert verdict.passed_fraction == pytest.approx(0.75) and verdict.reward == pytest.approx(0.75)
    assert verdict.reason.startswith("mean over steps: create 2/2 tests passed")


def test_the_final_strategy_takes_the_last_verified_step(task):
    final = dataclasses.replace(task, multi_step_reward_strategy="final")
    with TerminalTaskAttempt(final, scheme="binary") as attempt:
        verdict, _ = run_steps(attempt, lambda step, instruction: attempt.run_command("printf '# Notes\\n' > notes.md"))
    assert verdict.passed_fraction == 0.5 and verdict.reward == 0.0  # extend: notes.md lacks the bullets


def test_a_link_the_agent_plants_for_the_next_steps_files_writes_nothing_outside(task, tmp_path):
    """Step one's agent links ``items.txt`` (which step two's ``workdir/`` brings) to a host file: the trainer
    replaces the link with the step's file; the host file is untouched."""
    victim = tmp_path / "victim.txt"
    victim.write_text("host's own\n")
    victim.chmod(0o666)
    commands = {"create": f"printf '# Notes\\n' > notes.md && ln -s {victim} items.txt", "extend": "true"}
    with TerminalTaskAttempt(task) as attempt:
        _, outcomes = run_steps(attempt, lambda step, instruction: attempt.run_command(commands[step.name]))
        items = attempt.attempt.app / "items.txt"
        assert not items.is_symlink() and items.read_text().startswith("apples")
    assert victim.read_text() == "host's own\n"
    assert [outcome.name for outcome in outcomes] == ["create", "extend"]
