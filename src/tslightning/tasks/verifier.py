"""Run a task's verifier on an attempt and turn its reward file into the trajectory's reward.

The verifier runs after the agent is done, in the same attempt directory: ``tests/`` is copied in only now (the
agent never sees it), ``bash /tests/test.sh`` runs in the task's working directory with ``/app``, ``/tests`` and
``/logs/verifier`` visible and the task's ``[verifier] timeout_sec``, and the reward files it leaves in
``/logs/verifier`` are read (:mod:`tslightning.tasks.rewards`). A verifier that times out, or leaves no usable
reward file, scores 0 with a reason. In a live environment the verifier runs as in Harbor, while the agent's
processes are still alive (a service it started answers on loopback; a compose task's helper services answer by
name, :mod:`~tslightning.tasks.environment.helper_services`), but beside them, not among them: its own PID and mount
namespaces and host uid (:mod:`~tslightning.sandbox.live_verification`); the environment ends when the verifier returns,
before the reward files are read.

**Reward integrity.** A verifier may execute files the agent wrote (``python3 /app/stats.py``), as the same user, so
code the agent wrote runs beside the verifier. Layer by layer, what keeps it from changing the reported reward:

1. Each verification gets a fresh copy of the task's ``tests/``, bound read-only at ``/tests``, and a fresh, empty
   ``/logs/verifier``: nothing left from an earlier run or written to the tests can count. Beside a live
   environment, both exist only in the verifier's mount namespace, the log directory belongs to the verifier's own
   host uid (mode 0700), and the agent's processes still running can neither see, signal nor trace the verifier's
   processes (another PID namespace and uid), nor reach them through ``/proc`` or an inherited descriptor.
2. The run is a verifier run (``Sandbox.run(..., verifier=True)``): ``ptrace`` is refused and the verifier's shells
   are not dumpable (no tracing, no writes to their memory); ``prlimit`` on another process is refused (no failing
   the verifier's writes); a process orphaned while ``test.sh`` runs (one the agent's code left behind, racing the
   verifier's final write) is killed at once and the time it died is reported.
3. The sandbox's whole PID namespace is gone before the reward files are read, and so is the live environment's:
   no late writer survives.
4. ``test.sh`` ended by a signal (killed by the agent's code, or by a limit; as a shell reports it, exit status
   128 + N counts too) scores 0.
5. The reward files must be what a plain write by the verifier leaves (regular files, one link, owner read/write,
   in an unchanged directory), and ``reward.txt`` and ``reward.json`` must agree when both exist
   (:func:`~tslightning.tasks.rewards.read_reward_files`).
6. A reward file that last changed before an orphan of the verifier's commands had died may be the orphan's: 0.

Each refusal scores 0 with a reason. What remains the task's to get right: a verifier must write its reward file on
every path after running the agent's code (a forged file survives a verifier that exits first), and a harness that
imports the agent's code into its own process (pytest importing ``/app`` modules) can be subverted by that code.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from tslightning.sandbox import CommandResult, Sandbox
from tslightning.sandbox.file_tree import remove_tree
from tslightning.tasks.environment.offline_toolchain import toolchain_env
from tslightning.tasks.harbor.task_config import VerifierSettings
from tslightning.tasks.rewards import DEFAULT_REWARD_KEY, RewardReading, RewardScheme, read_reward_files
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


def run_verifier(
    task: TerminalTask,
    sandbox: Sandbox,
    scheme: RewardScheme = "seta",
    reward_key: str = DEFAULT_REWARD_KEY,
    tests: Path | None = None,
    settings: VerifierSettings | None = None,
) -> VerifierResult:
    """Copy ``task``'s tests into the sandbox's attempt, run ``tests/test.sh`` there and score the reward file (see
    "Reward integrity" in the module docstring).

    Args:
        task: The task.
        sandbox: The attempt's sandbox.
        scheme: Reward scheme of the pass fraction.
        reward_key: The named reward of ``reward.json`` read as the pass fraction.
        tests: The tests directory to copy (default: the task's ``tests/``; a step's layered tests).
        settings: The verifier's timeout and environment (default: the task's ``[verifier]``).
    """
    attempt = sandbox.attempt
    settings = settings or task.verifier
    try:
        _fresh_copy(tests or task.tests_dir, attempt.tests)
        _fresh_copy(None, attempt.logs)  # only this run's reward files count
    finally:
        attempt.wrote_from_host()
    result = sandbox.run(
        VERIFIER_COMMAND,
        limits=task.sandbox_limits(settings.timeout_sec),
        mounts=("app", "tests", "logs"),
        cwd=task.workdir,
        env=toolchain_env(sandbox, {**task.command_env, **settings.env}),
        verifier=True,
    )
    return score_verifier_run(result, read_reward_files(attempt.logs, reward_key), settings.timeout_sec, scheme)


def run_reference_solution(
    task: TerminalTask, sandbox: Sandbox, solution_dir: Path | None = None, timeout_s: float | None = None
) -> CommandResult:
    """Run ``solve.sh`` as the oracle agent: ``/app`` and ``/oracle`` visible, the task's agent timeout.

    Args:
        task: The task.
        sandbox: The attempt's sandbox.
        solution_dir: The solution to run (default: the task's ``solution/``; a step's own).
        timeout_s: Its wall clock (default: ``[agent] timeout_sec``, else :data:`REFERENCE_TIMEOUT_S`).
    """
    if solution_dir is None and task.solution_script is None:
        raise FileNotFoundError(f"task {task.name!r} has no solution/solve.sh")
    try:
        _refill(solution_dir or task.solution_dir, sandbox.attempt.oracle)
    finally:
        sandbox.attempt.wrote_from_host()
    timeout = timeout_s or (task.agent.timeout_sec if task.agent.timeout_sec is not None else REFERENCE_TIMEOUT_S)
    return sandbox.run(
        ORACLE_COMMAND,
        limits=task.sandbox_limits(timeout),
        mounts=("app", "oracle"),
        cwd=task.workdir,
        env=toolchain_env(sandbox, {**task.command_env, **task.solution_env}),
    )


def score_verifier_run(
    result: CommandResult, reading: RewardReading, timeout_s: float, scheme: RewardScheme
) -> VerifierResult:
    """Combine the verifier's command result and its reward files into a :class:`VerifierResult`."""
    common = dict(output=result.output, exit_code=result.exit_code, timed_out=result.timed_out, reading=reading)
    reason = _refusal(result, reading, timeout_s)
    if reason is not None:
        return VerifierResult(reward=0.0, passed_fraction=None, reason=f"{reason}; reward 0", **common)
    return VerifierResult(
        reward=reading.reward(scheme), passed_fraction=reading.passed_fraction, reason=reading.describe(), **common
    )


def _refusal(result: CommandResult, reading: RewardReading, timeout_s: float) -> str | None:
    """Why the verifier's run gives no reward (timeout, killed, unusable or suspect reward files), else None."""
    if result.timed_out:
        return f"verifier timed out after {timeout_s:g} s (exit code {result.exit_code})"
    if result.signal is not None:
        limit = f", limit hit: {result.limit_hit}" if result.limit_hit else ""
        return f"verifier tests/test.sh was ended by {result.signal} (exit code {result.exit_code}{limit})"
    if reading.error is not None:
        return f"{reading.error} (verifier exit code {result.exit_code})"
    last_orphan = result.last_orphan_death_ns
    if last_orphan is not None and reading.changed_ns is not None and reading.changed_ns <= last_orphan:
        names = ", ".join(sorted({orphan.name for orphan in result.orphans})) or "?"
        return (
            f"{reading.source} last changed before {result.orphan_count} process(es) orphaned by the verifier's "
            f"commands ({names}) had been killed, so one of them may have written it"
        )
    return None


def _refill(source: Path, target: Path) -> None:
    """Replace ``target``'s contents with a copy of ``source``'s, keeping the directory itself (a live environment
    shows it through a bind mount made when it started)."""
    for child in list(target.iterdir()):
        if child.is_dir() and not child.is_symlink():
            remove_tree(child)
        else:
            child.unlink()
    shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)


def _fresh_copy(source: Path | None, target: Path) -> None:
    """Replace ``target`` with a copy of ``source`` (an empty directory for None), whatever ``target`` holds."""
    if target.exists() or target.is_symlink():
        remove_tree(target)
    if source is None:
        target.mkdir(mode=0o755)
    else:
        shutil.copytree(source, target, symlinks=True)
