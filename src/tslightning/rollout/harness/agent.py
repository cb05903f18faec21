"""An agent harness in place of the built-in agent loop: the rollout DataModule's agent when ``fit`` trains one.

:meth:`HarnessAgent.run` has :meth:`~tslightning.rollout.agent_loop.AgentLoop.run`'s contract: one attempt to its
end, then the verifier, returning the trajectory with its reward. It opens the attempt at the gateway, runs the
harness program for it (:mod:`~tslightning.rollout.harness.process`), closes the attempt, and runs the
task's verifier in the same live environment the harness's commands ran in — so the trajectory becomes a source the
moment its reward exists, exactly as the built-in loop's. OPD turns reach the teacher as the gateway answers them.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from tslightning.rollout.agent_loop import AgentLimits, AgentTurn, TaskAttempt, TurnCallback
from tslightning.rollout.gateway.attempt_log import attempt_log_dir
from tslightning.rollout.gateway.server import OpenAIGateway
from tslightning.rollout.gateway.trajectory import HarnessTrajectory
from tslightning.rollout.harness.process import HarnessConnection, HarnessExit, HarnessProgram

__all__ = ["HarnessAgent", "HarnessError"]


class HarnessError(RuntimeError):
    """A harness that cannot produce a trajectory (it made no call), or an attempt whose calls the engine failed."""


class HarnessAgent:
    """Runs ``program`` once per attempt against ``gateway``.

    Args:
        gateway: This rank's gateway (started); closed with the agent.
        program: The harness program run per attempt.
        log_dir: Attempt logs (:mod:`~tslightning.rollout.gateway.attempt_log`) and the harness's working
            directories go under it; ``None``: temporary directories, no logs.
    """

    def __init__(self, gateway: OpenAIGateway, program: HarnessProgram, log_dir: Path | None = None) -> None:
        self.gateway, self.program, self.log_dir = gateway, program, log_dir

    @property
    def limits(self) -> AgentLimits:
        return self.gateway.limits

    async def run(
        self,
        task_id: str,
        instruction: str,
        attempt: TaskAttempt,
        group_id: str,
        trajectory_index: int,
        update: int,
        on_turn: TurnCallback | None = None,
    ) -> HarnessTrajectory:
        """Run one attempt: the harness to its end, then the verifier; returns the trajectory with its reward.

        ``on_turn`` is called on this coroutine's event loop as soon as a call's sampled ids are fixed.

        Raises:
            HarnessError: the harness made no call (it cannot have been the policy's doing: nothing was sampled),
                or the engine failed one of its calls.
        """
        loop = asyncio.get_running_loop()
        directory = None if self.log_dir is None else attempt_log_dir(self.log_dir, update, group_id, trajectory_index)
        listener = None if on_turn is None else _on_loop(loop, on_turn)
        session = self.gateway.open_attempt(task_id, group_id, trajectory_index, update, attempt, listener, directory)
        try:
            connection = HarnessConnection(
                self.gateway.base_url, session.key, self.gateway.model_name, self.limits.max_turns
            )
            ended = await self.program.run(connection, instruction, directory)
        finally:
            trajectory = await asyncio.to_thread(self.gateway.close_attempt, session)
        _check(session, trajectory, ended, directory)
        trajectory.end_reason = _end_reason(session.end_reason, ended)
        trajectory.reward = float(await asyncio.to_thread(attempt.verify))
        return trajectory

    def close(self) -> None:
        """Stop the gateway."""
        self.gateway.close()


def _on_loop(loop: asyncio.AbstractEventLoop, on_turn: TurnCallback):
    """``on_turn``, called on ``loop`` (the gateway answers on its own thread)."""

    def notify(trajectory: HarnessTrajectory, turn: AgentTurn) -> None:
        loop.call_soon_threadsafe(on_turn, trajectory, turn)

    return notify


def _check(session, trajectory: HarnessTrajectory, ended: HarnessExit, directory: Path | None) -> None:
    where = f"; its output is in {directory / 'harness.log'}" if directory is not None else ""
    if session.failure is not None:
        raise HarnessError(session.failure)
    if not trajectory.turns:
        how = "ran out of time" if ended.timed_out else f"exited with status {ended.returncode}"
        raise HarnessError(
            f"the harness of attempt {session.label} {how} before its first model call{where}; last output:\n"
            f"{ended.output_tail[-1500:]}"
        )


def _end_reason(refused: str, ended: HarnessExit) -> str:
    """Why the attempt ended: the limit that refused a call, else how the harness process ended."""
    if refused != "running":
        return refused
    if ended.timed_out:
        return "harness_timeout"
    return "finished" if ended.returncode == 0 else f"harness_exit_{ended.returncode}"
