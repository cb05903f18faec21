"""The rollout DataModule: runs each update's attempts and yields objective sources in readiness order.

For update k it registers the logical batch (:class:`~tslightning.core.batch_registry.BatchPlan` at the engine's current
policy version), starts every attempt concurrently on a background event loop, and yields — in the order they
become ready — GRPO trajectory sources (when their reward arrives) or OPD turn sources (when the teacher has scored
them), the completion events, and finally ``BatchClosed``. Each item's ready time and policy version are recorded
in :attr:`RolloutDataModule.ready_log` (the release trace's τ_j, App. B).
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import BatchClosed, GroupClosed, StreamItem, TrajectoryClosed
from tslightning.distributed.rank_assignment import RankAssignment, units_of
from tslightning.rollout.admission_order import AdmissionOrder, LengthHistory
from tslightning.rollout.agent_loop import AgentLimits, AgentLoop, AgentTrajectory, AgentTurn, TaskAttempt
from tslightning.rollout.continuous_rollout import ContinuousRollout, RolloutFailure
from tslightning.rollout.engine import RolloutEngine
from tslightning.rollout.environment_prefetch import EnvironmentPrefetch, PreparedEnvironment
from tslightning.rollout.environment_setup import EnvironmentSetup, wait_for_prepared
from tslightning.rollout.ready_items import ReadyItems
from tslightning.rollout.teacher import TeacherScorer
from tslightning.rollout.teacher_server import TeacherServer
from tslightning.rollout.tool_threads import run_with_tool_threads


class RolloutTask(Protocol):
    """What the DataModule needs of a task: an id and the instruction the agent sees."""

    task_id: str
    instruction: str


AttemptFactory = Callable[[RolloutTask], AbstractContextManager[TaskAttempt]]
"""Opens a fresh environment for one attempt of a task (sandbox + verifier) and cleans it up afterwards."""


class Agent(Protocol):
    """What acts in an attempt: :class:`~tslightning.rollout.agent_loop.AgentLoop`, or a harness through the gateway
    (:class:`~tslightning.rollout.harness.agent.HarnessAgent`)."""

    limits: AgentLimits

    async def run(
        self, task_id: str, instruction: str, attempt: TaskAttempt, group_id: str, index: int, update: int, on_turn=None
    ) -> AgentTrajectory: ...


@dataclass(frozen=True)
class ReadyRecord:
    """When one stream item became ready, relative to the update's first rollout request (seconds)."""

    update: int
    kind: str
    group_id: str | None
    trajectory_index: int | None
    turn_index: int | None
    policy_version: int
    ready_time: float


@dataclass(frozen=True)
class EnvironmentRecord:
    """How one attempt got its environment.

    Attributes:
        update: The update.
        group_id: The attempt's group.
        trajectory_index: Its index in the group.
        prefetched: It took a prefetched environment.
        ready: That environment was already set up when the attempt began (its set-up was off the critical path).
        wait_s: Seconds the attempt waited for its environment (a fresh one's whole set-up).
    """

    update: int
    group_id: str
    trajectory_index: int
    prefetched: bool
    ready: bool
    wait_s: float


class RolloutDataModule(ContinuousRollout, L.LightningDataModule):
    """Yields ready sources of each update as they arrive.

    Args:
        engine: The rollout engine; its ``policy_version`` stamps each logical batch.
        tokenizer: The policy's tokenizer.
        tasks: Training tasks; each update takes ``prompts_per_update`` of them in a seeded order.
        attempt_factory: Opens a fresh sandboxed attempt of a task.
        objective: ``grpo`` (trajectory sources) or ``opd`` (teacher-scored turn sources).
        prompts_per_update: P, prompts (groups) per logical batch.
        samples_per_prompt: m, trajectories per prompt.
        limits: Agent limits (Table 6).
        teacher: Required for OPD: scores each turn as soon as its action is fixed.
        run_seed: Seeds task order and sampling.
        updates: How many updates ``train_dataloader`` yields (``None``: until stopped).
        max_concurrent_attempts: Attempts in flight at once (tools and generation of the others overlap).
        rank: This learner rank's global rank: it rolls out only the groups (GRPO) or trajectories (OPD) that
            :mod:`tslightning.distributed.rank_assignment` gives it, with its own engine, and registers only those.
        world_size: Learner ranks sharing each logical batch of ``prompts_per_update`` prompts.
        cpus: Cores the agent loop runs on (its event-loop thread and tool threads), e.g. the rollout replicas'
            cores, so the loop's Python work does not compete with a learner in this process; ``None``: unchanged.
        prefetch_environments: When update k's last attempt has opened its environment, open update k+1's first
            this many attempt environments ahead (:mod:`~tslightning.rollout.environment_prefetch`), while update
            k's turns, tools, verifiers, the learner's tail, barrier and publication run; 0: every attempt opens its
            own when it starts. Schedules that roll
            out one update at a time (``sync``, ``thundersync``, ``async``), not ``stream_continuous``.
        agent: What acts in each attempt; ``None``: the built-in :class:`~tslightning.rollout.agent_loop.AgentLoop`
            on ``engine`` with ``limits`` (a harness agent brings its own gateway in front of ``engine``).
        admission_order: Which attempts start first when ``max_concurrent_attempts`` is below the batch: ``task``
            order, or ``longest_first`` by each task's sampled length in its last update (the same trajectories are
            sampled either way, :mod:`~tslightning.rollout.admission_order`).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        tasks: Sequence[RolloutTask],
        attempt_factory: AttemptFactory,
        objective: Objective = Objective.GRPO,
        prompts_per_update: int = 32,
        samples_per_prompt: int = 8,
        limits: AgentLimits | None = None,
        teacher: TeacherScorer | TeacherServer | None = None,
        run_seed: int = 0,
        updates: int | None = None,
        max_concurrent_attempts: int = 16,
        rank: int = 0,
        world_size: int = 1,
        cpus: Sequence[int] | None = None,
        prefetch_environments: int = 0,
        agent: Agent | None = None,
        admission_order: AdmissionOrder = "task",
    ) -> None:
        super().__init__()
        self.objective = Objective(objective)
        problems = []
        if not tasks:
            problems.append("tasks is empty: give at least one training task")
        if prompts_per_update < 1 or samples_per_prompt < 1:
            problems.append("prompts_per_update and samples_per_prompt must be >= 1")
        if self.objective is Objective.OPD and teacher is None:
            problems.append("objective 'opd' needs a teacher (TeacherScorer or TeacherServer) to score turns")
        if max_concurrent_attempts < 1:
            problems.append("max_concurrent_attempts must be >= 1")
        if cpus is not None and not cpus:
            problems.append("cpus is empty: list at least one core, or None to leave placement alone")
        if not 0 <= rank < world_size:
            problems.append(f"rank must be in [0, world_size); got rank={rank}, world_size={world_size}")
        if prefetch_environments < 0:
            problems.append(f"prefetch_environments must be >= 0 (0: off); got {prefetch_environments}")
        if problems:
            raise ValueError("RolloutDataModule: " + "; ".join(problems))
        self.engine = engine
        self.tasks = list(tasks)
        self.attempt_factory = attempt_factory
        self.prompts_per_update = prompts_per_update
        self.samples_per_prompt = samples_per_prompt
        self.agent = agent or AgentLoop(engine, tokenizer, limits, run_seed)
        self.teacher = teacher
        self.run_seed = run_seed
        self.updates = updates
        self.max_concurrent_attempts = max_concurrent_attempts
        self.cpus = None if cpus is None else list(cpus)
        self.rank = rank
        self.world_size = world_size
        self.spread_groups = False
        """GRPO: deal each group's trajectories over the ranks (:meth:`share_with`) instead of whole groups."""
        self.tokenizer = tokenizer
        self.ready_log: list[ReadyRecord] = []
        self.trajectories: dict[int, list[AgentTrajectory]] = {}
        self.dropped_groups = 0
        """``fully_async``: groups dropped for exceeding the staleness bound."""
        self.update_starts: dict[int, float] = {}
        """``time.perf_counter()`` at each update's first rollout request; ready times are relative to it."""
        self.environment_log: list[EnvironmentRecord] = []
        """Per attempt: how long it waited for its environment, and whether a prefetched one was ready."""
        self.prefetch = (
            EnvironmentPrefetch(attempt_factory, prefetch_environments, self.cpus) if prefetch_environments else None
        )
        self.environment_setup = EnvironmentSetup(attempt_factory, self.cpus)
        self.admission_order = admission_order
        self.lengths = LengthHistory()
        """Each task's sampled tokens per trajectory in its last update (``longest_first``'s prediction)."""
        """Opens and closes the attempts' environments on threads of their own, off the agent loop."""
        self._unopened: dict[int, int] = {}
        """Per update: its attempts that have not opened their environment yet."""

    def tasks_for_update(self, update: int) -> list[RolloutTask]:
        """The P tasks of update ``update``: a seeded permutation per pass over the task list, no arrival effects."""
        slots = range(update * self.prompts_per_update, (update + 1) * self.prompts_per_update)
        return [self._task_for_slot(slot) for slot in slots]

    def share_with(self, rank: int, world_size: int, spread_groups: bool = False) -> None:
        """Roll out only learner rank ``rank``'s share of each batch from now on (``fit`` calls this once Fabric has
        launched the ranks); ``spread_groups`` (GRPO under ``learner.shard_statistics``): a share of every group's
        trajectories (:meth:`~tslightning.distributed.rank_assignment.RankAssignment.spread_groups`), each sampled
        with the seed it has on one rank."""
        if not 0 <= rank < world_size:
            raise ValueError(f"RolloutDataModule: rank must be in [0, world_size); got {rank=}, {world_size=}")
        self.rank, self.world_size = rank, world_size
        self.spread_groups = spread_groups and self.objective is Objective.GRPO

    def rank_plan(self, plan: BatchPlan, tasks: dict[str, RolloutTask]) -> BatchPlan:
        """This rank's share of the whole-batch ``plan``, balanced by expected tokens: each trajectory's prompt
        (the task instruction) plus its token budget ``max_tokens_per_trajectory``; the plan keeps the global P."""
        if self.world_size == 1:
            return plan
        if self.spread_groups:
            return RankAssignment.spread_groups(plan, self.world_size).rank_plan(self.rank)
        budget = self.agent.limits.max_tokens_per_trajectory
        per_trajectory = {g: len(self.tokenizer.encode(task.instruction)) + budget for g, task in tasks.items()}
        costs = {(g, i): per_trajectory[g] * (self.samples_per_prompt if i is None else 1) for g, i in units_of(plan)}
        return RankAssignment.balanced(plan, costs, self.world_size).rank_plan(self.rank)

    def rank_tasks(self, update: int, version: int) -> tuple[BatchPlan, dict[str, tuple[RolloutTask, list[int]]]]:
        """Update ``update``'s plan at ``version`` (this rank's share) and, per group id, its task and this rank's
        trajectory indices, in the order the attempts start. Nothing here depends on the policy's weights."""
        tasks = {f"u{update}/p{p}/{task.task_id}": task for p, task in enumerate(self.tasks_for_update(update))}
        plan = self.rank_plan(BatchPlan(self.objective, version, {g: self.samples_per_prompt for g in tasks}), tasks)
        return plan, {g: (tasks[g], sorted(plan.trajectory_indices(g))) for g in plan.group_sizes}

    def stream_update(self, update: int) -> ReadyItems:
        """Update ``update``'s stream: its plan (stamped at the engine's version when taken), then — its rollouts
        running from then on — items in readiness order, ending with BatchClosed; ``take_ready()`` gives those ready
        now without waiting."""

        def start():
            version = self.engine.policy_version
            plan, tasks = self.rank_tasks(update, version)

            def begin(ready: queue.Queue) -> threading.Thread:
                start = self.update_starts[update] = time.perf_counter()
                name = f"rollout-u{update}"
                producer = threading.Thread(
                    target=self._produce, args=(update, version, tasks, ready, start), name=name, daemon=True
                )
                producer.start()
                return producer

            return plan, begin

        return ReadyItems(update, start)

    def _task_for_slot(self, slot: int) -> RolloutTask:
        epoch, position = divmod(slot, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(f"{self.run_seed}/{epoch}").shuffle(order)
        return self.tasks[order[position]]

    def train_dataloader(self) -> DataLoader:
        """One update per Trainer batch: each batch is a generator that runs the update's rollout when the learner
        first iterates it, so the DataLoader's prefetch samples nothing ahead of the publication (pair with
        ``StreamingPolicyModule.training_step``). It starts at the attached Trainer's ``global_step``, so a run
        resumed with ``fit(ckpt_path=...)`` continues at its next update. Generators cannot cross to worker
        processes: ``num_workers=0``."""
        return DataLoader(_UpdateStream(self), batch_size=None, num_workers=0, collate_fn=_update_as_is)

    # ------------------------------------------------------------------ producer side (background event loop)
    def _produce(self, update: int, version: int, tasks: dict, ready: queue.Queue, start: float) -> None:
        def emit(item: StreamItem) -> None:
            self._record(update, item, version, time.perf_counter() - start)
            ready.put(item)

        try:
            trajectories = run_with_tool_threads(
                self._rollout(update, tasks, emit), self.max_concurrent_attempts, self.cpus
            )
            self.trajectories[update] = trajectories
            self.lengths.record(trajectories)
            emit(BatchClosed(version))
        except BaseException as error:  # surfaced in the consumer, never swallowed
            self._unopened.pop(update, None)
            if self.prefetch is not None:
                self.prefetch.discard()
            ready.put(RolloutFailure(error))

    def _prefetch_after(self, update: int) -> None:
        """Close what update ``update`` left prepared; prepare update ``update + 1``'s first environments."""
        if self.prefetch is None:
            return
        if self.updates is not None and update + 1 >= self.updates:
            self.prefetch.discard()
            return
        _, tasks = self.rank_tasks(update + 1, self.engine.policy_version)  # the version only stamps the plan
        self.prefetch.prepare(update + 1, [task for task, indices in tasks.values() for _ in indices])

    async def _open_attempt(self, update: int, group_id: str, index: int, task: RolloutTask) -> PreparedEnvironment:
        """The attempt's environment: a prefetched one of its task, else a fresh one; the wait is logged."""
        start = time.perf_counter()
        future = self.prefetch.take(update, task) if self.prefetch is not None else None
        ready = future is not None and future.done()
        prepared = await (wait_for_prepared(future) if future is not None else self.environment_setup.open(task))
        waited = time.perf_counter() - start
        self.environment_log.append(EnvironmentRecord(update, group_id, index, future is not None, ready, waited))
        self._unopened[update] -= 1
        if self._unopened[update] == 0:  # the update's set-up is done: the set-up threads turn to update k+1's
            del self._unopened[update]
            self._prefetch_after(update)
        return prepared

    def environment_seconds(self, update: int) -> float:
        """Seconds update ``update``'s attempts waited for their environments, summed over the attempts. Set-ups
        run on threads, several at once, while the other attempts' turns go on, so waits of attempts set up at once
        overlap and the sum can exceed the wall time; it is the set-up on the attempts' critical paths, not on the
        update's."""
        return sum(r.wait_s for r in self.environment_log if r.update == update)

    def prefetched_environments(self, update: int) -> int:
        """Attempts of update ``update`` that took a prefetched environment (see :attr:`environment_log` for which
        were already set up when the attempt began)."""
        return sum(r.prefetched for r in self.environment_log if r.update == update)

    def teardown(self, stage: str) -> None:
        """Close every prefetched environment no attempt took, and the prefetch and set-up threads (the run's
        end)."""
        if self.prefetch is not None:
            self.prefetch.close()
        self.environment_setup.shutdown()

    async def _rollout(self, update: int, tasks: dict, emit: Callable[[StreamItem], None]) -> list[AgentTrajectory]:
        gate = asyncio.Semaphore(self.max_concurrent_attempts)
        attempts = sum(len(indices) for _, indices in tasks.values())
        if attempts:
            self._unopened[update] = attempts
        else:  # this rank has no attempt this update: its set-up threads turn to update k+1's at once
            self._prefetch_after(update)

        async def group(group_id: str, task: RolloutTask, indices: list[int]) -> list[AgentTrajectory]:
            members = await asyncio.gather(*(self._attempt(update, group_id, task, i, gate, emit) for i in indices))
            emit(GroupClosed(group_id))
            return members

        if self.admission_order == "longest_first":  # only the start order changes, never what is sampled
            tasks = self.lengths.longest_first(tasks, {g: task.task_id for g, (task, _) in tasks.items()})
        groups = await asyncio.gather(*(group(g, task, indices) for g, (task, indices) in tasks.items()))
        return [t for members in groups for t in members]

    async def _attempt(
        self, update: int, group_id: str, task: RolloutTask, index: int, gate: asyncio.Semaphore, emit
    ) -> AgentTrajectory:
        scoring: list[asyncio.Task] = []
        loop = asyncio.get_running_loop()

        def on_turn(trajectory: AgentTrajectory, turn: AgentTurn) -> None:
            if self.objective is Objective.OPD:
                scoring.append(loop.create_task(self._score_turn(trajectory, turn, emit)))

        async with gate:
            prepared = await self._open_attempt(update, group_id, index, task)
            try:
                trajectory = await self.agent.run(
                    task.task_id, task.instruction, prepared.attempt, group_id, index, update, on_turn
                )
            finally:
                await self.environment_setup.close(prepared)
        if self.objective is Objective.GRPO:
            emit(trajectory.trajectory_source())
        else:
            await asyncio.gather(*scoring)
            emit(TrajectoryClosed(group_id, index, len(trajectory.turns)))
        return trajectory

    async def _score_turn(self, trajectory: AgentTrajectory, turn: AgentTurn, emit) -> None:
        token_ids = trajectory.token_ids(through_turn=turn.index)
        mask = trajectory.scored_mask(only_turn=turn.index)
        logprobs = await asyncio.wrap_future(self.teacher.submit(token_ids, mask))
        trajectory.teacher_logprobs[turn.index] = logprobs
        emit(trajectory.turn_source(turn.index, logprobs))

    def _record(self, update: int, item: StreamItem, version: int, ready_time: float) -> None:
        self.ready_log.append(
            ReadyRecord(
                update=update,
                kind=type(item).__name__,
                group_id=getattr(item, "group_id", None),
                trajectory_index=getattr(item, "trajectory_index", None),
                turn_index=getattr(item, "turn_index", None),
                policy_version=getattr(item, "policy_version", version),
                ready_time=ready_time,
            )
        )


class _UpdateStream(IterableDataset):
    """Successive updates' streams, one lazy generator each; update k+1's rollout starts when the learner starts it."""

    def __init__(self, datamodule: RolloutDataModule) -> None:
        self.datamodule = datamodule

    def __iter__(self) -> Iterator[Iterator[BatchPlan | StreamItem]]:
        trainer = self.datamodule.trainer
        update = 0 if trainer is None else trainer.global_step
        while self.datamodule.updates is None or update < self.datamodule.updates:
            yield self.datamodule.stream_update(update)
            update += 1


def _update_as_is(update: Iterator[BatchPlan | StreamItem]) -> Iterator[BatchPlan | StreamItem]:
    return update
