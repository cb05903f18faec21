"""Run a task's verifier on an attempt and turn its reward file into the trajectory's reward.

The verifier runs after the agent is done, in the same attempt directory: ``tests/`` is copied in only now (the
agent never sees it), ``bash /tests/test.sh`` runs with ``/app``, ``/tests`` and ``/logs/verifier`` visible and the
task's ``[verifier] timeout_sec``, and the reward files it leaves in ``/logs/verifier`` are read
(:mod:`tslightning.tasks.rewards`). A verifier that times out, or leaves no usable reward file, scores 0 with a reason.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tslightning.sandbox import CommandResult, Sandbox
from tslightning.tasks.rewards import RewardReading, RewardScheme, read_reward_files
from tslightning.tasks.terminal_task import TerminalTask

VERIFIER_COMMAND = "bash /tests/test.sh"
ORACLE_COMMAND = "bash /oracle/solve.sh"
OUTPUT_TAIL_CHARS = 2000
REFERENCE_TIMEOUT_S = 600.0
"""Wall-clock limit of ``solution/solve.sh`` when the task sets no ``[agent] timeout_sec``."""


@dataclass(frozen=True)
class VerifierResult:
    """The verifier's verdict on one attempt.

    Attributes:
        reward: The reward under the scheme asked for (0 on timeout or a missing / malformed reward file).
        passed_fraction: Fraction of the verifier's tests that passed; ``None`` when it could not be read.
        reason: One line saying how the reward came about (counts, or what went wrong).
        output: The verifier's combined stdout and stderr.
        exit_code: ``test.sh``'s exit status.
        timed_out: Whether the verifier ran past its timeout.
        reading: What the reward files said.
    """

    reward: float
    passed_fraction: float | None
    reason: str
    output: str
    exit_code: int | None = None
    timed_out: bool = False
    reading: RewardReading | None = None

    @property
    def passed(self) -> bool:
        """Every verifier test passed (``p = 1``)."""
        return self.passed_fraction == 1.0

    def output_tail(self, chars: int = OUTPUT_TAIL_CHARS) -> str:
        """The last ``chars`` characters of the output, for error messages."""
        return self.output if len(self.output) <= chars else "..." + self.output[-chars:]


def run_verifier(task: TerminalTask, sandbox: Sandbox, scheme: RewardScheme = "seta") -> VerifierResult:
    """Copy ``task``'s tests into the sandbox's attempt, run ``tests/test.sh`` there and score the reward file."""
    attempt = sandbox.attempt
    _replace_dir_contents(attempt.tests, task.tests_dir)
    _clear_dir(attempt.logs)  # only this run's reward files count
    result = sandbox.run(
        VERIFIER_COMMAND,
        limits=task.verifier_limits(),
        mounts=("app", "tests", "logs"),
        env=task.verifier.env or None,
    )
    return score_verifier_run(result, read_reward_files(attempt.logs), task.verifier.timeout_sec, scheme)


def run_reference_solution(task: TerminalTask, sandbox: Sandbox) -> CommandResult:
    """Run ``solution/solve.sh`` as the oracle agent: ``/app`` and ``/oracle`` visible, the task's agent timeout."""
    if task.solution_script is None:
        raise FileNotFoundError(f"task {task.name!r} has no solution/solve.sh")
    _replace_dir_contents(sandbox.attempt.oracle, task.solution_dir)
    timeout = task.agent.timeout_sec if task.agent.timeout_sec is not None else REFERENCE_TIMEOUT_S
    return sandbox.run(
        ORACLE_COMMAND,
        limits=task.sandbox_limits(timeout),
        mounts=("app", "oracle"),
        env=task.solution_env or None,
    )


def score_verifier_run(
    result: CommandResult, reading: RewardReading, timeout_s: float, scheme: RewardScheme
) -> VerifierResult:
    """Combine the verifier's command result and its reward files into a :class:`VerifierResult`."""
    common = dict(output=result.output, exit_code=result.exit_code, timed_out=result.timed_out, reading=reading)
    if result.timed_out:
        reason = f"verifier timed out after {timeout_s:g} s (exit code {result.exit_code}); reward 0"
        return VerifierResult(reward=0.0, passed_fraction=None, reason=reason, **common)
    if reading.error is not None:
        reason = f"{reading.error} (verifier exit code {result.exit_code}); reward 0"
        return VerifierResult(reward=0.0, passed_fraction=None, reason=reason, **common)
    return VerifierResult(
        reward=reading.reward(scheme), passed_fraction=reading.passed_fraction, reason=reading.describe(), **common
    )


def _replace_dir_contents(target: Path, source: Path) -> None:
    _clear_dir(target)
    shutil.copytree(source, target, dirs_exist_ok=True, symlinks=True)


def _clear_dir(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for child in directory.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
