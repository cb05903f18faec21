"""One attempt at a terminal task, as the agent loop sees it (``tslightning.rollout.agent_loop.TaskAttempt``).

The attempt owns a fresh attempt directory seeded from the task's ``environment/`` and its sandbox. The agent's
commands see only ``/app`` and run under the task's resources with Table 6's 120 s per command; :meth:`verify` then
runs the task's verifier (which alone sees ``/tests``) and returns the reward, keeping the full verdict in
:attr:`TerminalTaskAttempt.verification`.
"""

from __future__ import annotations

from types import TracebackType

from tslightning.sandbox import CommandResult
from tslightning.tasks.rewards import RewardScheme
from tslightning.tasks.terminal_task import AGENT_COMMAND_TIMEOUT_S, TerminalTask
from tslightning.tasks.validation import SandboxFactory, sandbox_factory
from tslightning.tasks.verifier import VerifierResult, run_verifier


class TerminalTaskAttempt:
    """A fresh environment for one trajectory on ``task``; close it (or use ``with``) to remove it.

    Args:
        task: The task to attempt.
        scheme: Reward scheme of the verifier's pass fraction (``seta`` partial or ``binary``).
        make_attempt_sandbox: Makes the attempt's sandbox (default: bubblewrap).
        command_timeout_s: Wall-clock limit of one agent command (Table 6: 120 s).
    """

    def __init__(
        self,
        task: TerminalTask,
        scheme: RewardScheme = "seta",
        make_attempt_sandbox: SandboxFactory | None = None,
        command_timeout_s: float = AGENT_COMMAND_TIMEOUT_S,
    ) -> None:
        self.task = task
        self.scheme = scheme
        self.attempt = task.open_attempt()
        try:
            self.sandbox = (make_attempt_sandbox or sandbox_factory())(self.attempt)
        except BaseException:
            self.attempt.close()
            raise
        self.command_limits = task.agent_limits(command_timeout_s)
        self.verification: VerifierResult | None = None

    def run_command(self, command: str) -> CommandResult:
        """Run one agent command in ``/app``; its failures come back in the result, never raised."""
        return self.sandbox.run(command, limits=self.command_limits, mounts=("app",))

    def verify(self) -> float:
        """Run the task's verifier on the attempt and return the reward (0 with a reason when it fails)."""
        self.verification = run_verifier(self.task, self.sandbox, self.scheme)
        return self.verification.reward

    def close(self) -> None:
        self.attempt.close()

    def __enter__(self) -> TerminalTaskAttempt:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
