"""``fully_async``'s rollout, which never stops (App. D.4's continuous variant): groups keep starting while the
learner trains, and each update takes the first P groups to complete, whatever policy versions sampled them.

Mixed into :class:`~tslightning.rollout.rollout_datamodule.RolloutDataModule` (:meth:`ContinuousRollout.
stream_continuous`), whose tasks, agent, environment set-up, trajectories and readiness log it uses.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import BatchClosed, GroupClosed, StreamItem
from tslightning.rollout.agent_loop import AgentTrajectory
from tslightning.rollout.tool_threads import run_with_tool_threads

__all__ = ["ContinuousRollout", "RolloutFailure"]


class RolloutFailure:
    """A rollout thread's error, carried to the consumer through the ready queue and raised there."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class ContinuousRollout:
    """The ``fully_async`` stream of a rollout DataModule."""

    def stream_continuous(
        self, updates: int, staleness_bound: int, learner_version: Callable[[], int]
    ) -> Iterator[list[BatchPlan | StreamItem]]:
        """``fully_async`` (GRPO): rollout never stops; yield one logical batch (a list of items) per update.

        Groups keep starting while at most ``(staleness_bound + 1)·P`` are outstanding; each update takes the first P
        groups to complete, whatever policy versions their turns were sampled with (publication swaps weights into
        the engine in flight, so a trajectory can span versions). A group whose oldest turn trails the learner by
        more than ``staleness_bound`` is dropped and counted in :attr:`dropped_groups`, never trained on silently.
        """
        if self.objective is not Objective.GRPO:
            raise ValueError("fully_async supports objective 'grpo' (OPD turn streaming needs the barrier per batch)")
        if self.world_size > 1:
            raise ValueError("fully_async runs on one learner rank (its batches are the first P groups to complete)")
        capacity = threading.Semaphore((staleness_bound + 1) * self.prompts_per_update)
        completed: queue.Queue = queue.Queue()
        total = (updates + staleness_bound + 1) * self.prompts_per_update
        stop = threading.Event()
        producer = threading.Thread(
            target=lambda: self._produce_continuously(total, capacity, completed, stop), daemon=True
        )
        producer.start()
        try:
            for update in range(updates):
                yield self._continuous_batch(update, staleness_bound, learner_version(), completed, capacity)
        finally:
            stop.set()
            for _ in range(total):
                capacity.release()  # unblock the producer so it can stop

    def _continuous_batch(self, update, staleness_bound, version, completed: queue.Queue, capacity) -> list:
        groups: list[tuple[str, list[AgentTrajectory]]] = []
        start = self.update_starts[update] = time.perf_counter()
        while len(groups) < self.prompts_per_update:
            item = completed.get()
            if isinstance(item, RolloutFailure):
                raise RuntimeError(f"continuous rollout failed: {item.error}") from item.error
            capacity.release()
            group_id, members = item
            if version - min(t.policy_version for t in members) > staleness_bound:
                self.dropped_groups += 1
                continue
            groups.append(item)
        sources = [t.trajectory_source() for _, members in groups for t in members]
        oldest = min(s.policy_version for s in sources)
        plan = BatchPlan(self.objective, version, {g: len(m) for g, m in groups}, oldest_policy_version=oldest)
        items = [plan, *sources, *(GroupClosed(g) for g, _ in groups), BatchClosed(version)]
        self.trajectories[update] = [t for _, members in groups for t in members]
        for item in items[1:]:
            self._record(update, item, version, time.perf_counter() - start)
        return items

    def _produce_continuously(self, total: int, capacity, completed: queue.Queue, stop: threading.Event) -> None:
        async def run() -> None:
            gate = asyncio.Semaphore(self.max_concurrent_attempts)
            running = []
            for slot in range(total):
                await asyncio.to_thread(capacity.acquire)
                if stop.is_set():
                    break
                task = self._task_for_slot(slot)
                running.append(asyncio.create_task(self._continuous_group(slot, task, gate, completed)))
            await asyncio.gather(*running)

        try:
            run_with_tool_threads(run(), self.max_concurrent_attempts + 1, self.cpus)  # + the capacity wait
        except BaseException as error:
            completed.put(RolloutFailure(error))

    async def _continuous_group(self, slot: int, task: Any, gate, completed: queue.Queue) -> None:
        group_id = f"g{slot}/{task.task_id}"
        members = await asyncio.gather(
            *(self._continuous_attempt(slot, group_id, task, i, gate) for i in range(self.samples_per_prompt))
        )
        completed.put((group_id, list(members)))

    async def _continuous_attempt(self, slot: int, group_id: str, task: Any, index: int, gate):
        async with gate:
            prepared = await self.environment_setup.open(task)
            try:
                return await self.agent.run(task.task_id, task.instruction, prepared.attempt, group_id, index, slot)
            finally:
                await self.environment_setup.close(prepared)
