"""Multi-step tasks (``[[steps]]``): an agent works through ordered steps in one environment, verified after each.

Per step, as Harbor runs them: the step's ``workdir/`` files are copied into the working directory and its
``setup.sh`` (if any) runs there; the agent acts on the step's instruction; the verifier runs with the task's
``tests/`` overlaid by the step's own ``tests/`` (a step's ``test.sh`` wins) and the step's ``[steps.verifier]``
settings (the task's, overridden key by key). A step whose reward is below its ``min_reward`` (a number: the pass
fraction; a table: each named reward) ends the attempt early. The attempt's pass fraction is the mean over the
steps that were verified (``mean``, Harbor's default) or the last one's (``final``).

Each step's verifier ends the attempt's live environment (see :mod:`~tslightning.sandbox.live_environment`): files
carry over to the next step, processes the agent left running do not (Harbor keeps one container across steps).

``tslightning tasks validate`` runs multi-step tasks (the no-op agent, and each step's ``solution/solve.sh``).
``fit`` does not train on them: the agent loop takes one instruction per trajectory, and a step's instruction
arrives mid-trajectory (``fit`` refuses them by name; see :mod:`tslightning.loop.task_selection`).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tslightning.tasks.harbor.task_config import StepSettings
from tslightning.tasks.rewards import reward_for
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TESTS_DIR, TerminalTask
from tslightning.tasks.verifier import VerifierResult

SETUP_SCRIPT = "setup.sh"
WORKDIR = "workdir"

StepAgent = Callable[[StepSettings, str], None]
"""Acts on one step: ``act(step, instruction)`` (the no-op agent does nothing; the oracle runs the step's solution)."""


@dataclass(frozen=True)
class StepOutcome:
    """One step's verdict (``None`` when a setup failure or an earlier abort kept it from being verified)."""

    name: str
    verification: VerifierResult | None
    note: str = ""


def run_steps(attempt: TerminalTaskAttempt, act: StepAgent) -> tuple[VerifierResult, list[StepOutcome]]:
    """Run every step of ``attempt.task`` in ``attempt``'s one environment; returns the attempt's verdict (its
    ``passed_fraction`` aggregated by the task's strategy, its reward under ``attempt.scheme``) and each step's."""
    task = attempt.task
    outcomes: list[StepOutcome] = []
    for step in task.steps:
        note = _prepare(attempt, task, step)
        if note:
            outcomes.append(StepOutcome(step.name, None, note))
            break
        act(step, task.step_instruction(step.name))
        with _layered_tests(task, step) as tests:
            attempt.verify(tests, step.verifier)
        outcomes.append(StepOutcome(step.name, attempt.verification))
        below = _below_minimum(step, attempt.verification)
        if below:
            outcomes[-1] = StepOutcome(step.name, attempt.verification, below)
            break
    return _aggregate(task, outcomes, attempt.scheme), outcomes


def _prepare(attempt: TerminalTaskAttempt, task: TerminalTask, step: StepSettings) -> str:
    """Copy the step's ``workdir/`` in and run its ``setup.sh``; a failure's description, else ``""``."""
    source = task.step_dir(step.name) / WORKDIR
    if not source.is_dir():
        return ""
    try:
        attempt.upload(source, attempt.workdir)
    except OSError as error:  # what the agent left in the way: this attempt's step fails, training goes on
        return f"step {step.name!r}: could not place its {WORKDIR}/: {error}"
    if not (source / SETUP_SCRIPT).is_file():
        return ""
    result = attempt.run_command(f"bash ./{SETUP_SCRIPT} && rm -f ./{SETUP_SCRIPT}")
    if result.ok:
        return ""
    return f"step {step.name!r}: {WORKDIR}/{SETUP_SCRIPT} exited {result.exit_code}: {result.output[-300:].strip()!r}"


class _layered_tests:  # noqa: N801 - a context manager read as a phrase
    """The task's ``tests/`` with the step's ``tests/`` copied over it, in a temporary directory."""

    def __init__(self, task: TerminalTask, step: StepSettings) -> None:
        self.layers = [task.tests_dir, task.step_dir(step.name) / TESTS_DIR]

    def __enter__(self) -> Path:
        self._dir = tempfile.TemporaryDirectory(prefix="tsl-step-tests-")
        merged = Path(self._dir.name) / TESTS_DIR
        merged.mkdir()
        for layer in self.layers:
            if layer.is_dir():
                shutil.copytree(layer, merged, symlinks=True, dirs_exist_ok=True)
        return merged

    def __exit__(self, *exc) -> None:
        self._dir.cleanup()


def _below_minimum(step: StepSettings, verdict: VerifierResult) -> str:
    """Why ``verdict`` misses the step's ``min_reward`` (ends the attempt), else ``""``."""
    if step.min_reward is None:
        return ""
    if isinstance(step.min_reward, float):
        fraction = verdict.passed_fraction if verdict.passed_fraction is not None else float("-inf")
        return f"below min_reward {step.min_reward:g}" if fraction < step.min_reward else ""
    named = verdict.reading.named if verdict.reading is not None else {}
    missed = [k for k, low in step.min_reward.items() if named.get(k, float("-inf")) < low]
    return f"below min_reward for {', '.join(missed)}" if missed else ""


def _aggregate(task: TerminalTask, outcomes: list[StepOutcome], scheme) -> VerifierResult:
    verified = [o for o in outcomes if o.verification is not None]
    fractions = [o.verification.passed_fraction or 0.0 for o in verified]
    if not fractions:
        fraction = None
    elif task.multi_step_reward_strategy == "final":
        fraction = fractions[-1]
    else:
        fraction = sum(fractions) / len(fractions)
    reason = f"{task.multi_step_reward_strategy} over steps: " + "; ".join(_describe(o) for o in outcomes)
    output = "\n".join(f"--- step {o.name}\n{o.verification.output}" for o in verified)
    reward = 0.0 if fraction is None else reward_for(fraction, scheme)
    return VerifierResult(reward=reward, passed_fraction=fraction, reason=reason, output=output)


def _describe(outcome: StepOutcome) -> str:
    text = outcome.name + (f" {outcome.verification.reason}" if outcome.verification else "")
    return f"{text} ({outcome.note})" if outcome.note else text
