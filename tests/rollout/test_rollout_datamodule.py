"""The rollout DataModule: ready sources in readiness order, stamped with the policy version, accepted as they
come by the streaming learner — whose update equals the batch-synchronous one on the same rollouts."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import pytest
import torch
from fakes import RecordingAttempt, ScriptedEngine

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import BatchClosed, GroupClosed, TrajectoryClosed, TrajectorySource, TurnSource
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.rollout.rollout_datamodule import RolloutDataModule
from tslightning.rollout.teacher import TeacherScorer


@dataclass(frozen=True)
class Task:
    task_id: str
    instruction: str


TASKS = [Task(f"task-{i}", f"Create file number {i} in /app") for i in range(5)]
REPLIES = {
    0: ["<bash>ls</bash>", "<bash>touch a</bash>", "<finish/>"],
    1: ["<finish/>"],
    2: ["thinking", "<bash>cat x</bash>", "<finish/>"],
}


def attempt_factory(delays: dict[str, float] | None = None):
    rewards = iter([1.0, 0.0, 0.5, 1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.5] * 10)

    @contextlib.contextmanager
    def open_attempt(task):
        yield RecordingAttempt(delay=(delays or {}).get(task.task_id, 0.0), reward=next(rewards))

    return open_attempt


def datamodule(tokenizer, objective="grpo", teacher=None, **kwargs):
    engine = ScriptedEngine(tokenizer, REPLIES, version=kwargs.pop("version", 0))
    return RolloutDataModule(
        engine,
        tokenizer,
        TASKS,
        attempt_factory(kwargs.pop("delays", None)),
        objective,
        prompts_per_update=2,
        samples_per_prompt=3,
        teacher=teacher,
        run_seed=1,
        **kwargs,
    )


def test_grpo_stream_is_plan_sources_events_batch_closed(tokenizer):
    dm = datamodule(tokenizer)
    items = list(dm.stream_update(0))
    assert isinstance(items[0], BatchPlan) and items[0].policy_version == 0
    assert isinstance(items[-1], BatchClosed)
    sources = [i for i in items if isinstance(i, TrajectorySource)]
    assert len(sources) == 6 and all(s.policy_version == 0 for s in sources)
    for group_id in items[0].group_sizes:  # every group closes after its own three sources
        position = next(k for k, i in enumerate(items) if isinstance(i, GroupClosed) and i.group_id == group_id)
        members = [k for k, i in enumerate(items) if isinstance(i, TrajectorySource) and i.group_id == group_id]
        assert len(members) == 3 and max(members) < position
    assert [r.kind for r in dm.ready_log] == [type(i).__name__ for i in items[1:]]
    times = [r.ready_time for r in dm.ready_log]
    assert times == sorted(times)  # yielded in readiness order


def test_sources_arrive_in_readiness_order_not_task_order(tokenizer):
    """Trajectories of a task whose tool is slow are released after faster ones from later groups."""
    tasks = datamodule(tokenizer).tasks_for_update(0)
    dm = datamodule(tokenizer, delays={tasks[0].task_id: 0.4})
    items = [i for i in dm.stream_update(0) if isinstance(i, TrajectorySource)]
    slow_group = next(g for g in {i.group_id for i in items} if tasks[0].task_id in g)
    slow_tool_trajectories = [
        k for k, i in enumerate(items) if i.group_id == slow_group and i.trajectory_index in (0, 2)
    ]
    assert min(slow_tool_trajectories) >= 3  # trajectories 0 and 2 call tools; the other group went first


def test_task_choice_is_seeded_and_covers_the_list(tokenizer):
    dm = datamodule(tokenizer)
    first = [t.task_id for u in range(3) for t in dm.tasks_for_update(u)]
    assert first == [t.task_id for u in range(3) for t in datamodule(tokenizer).tasks_for_update(u)]
    assert set(first[:5]) == {t.task_id for t in TASKS}  # one pass visits every task once


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_streaming_learner_consumes_the_stream_exactly(tokenizer, make_policy, teacher64, objective):
    teacher = TeacherScorer(teacher64) if objective == "opd" else None
    try:
        items = list(datamodule(tokenizer, objective, teacher).stream_update(0))
    finally:
        if teacher:
            teacher.close()
    directions = []
    for schedule in ("thundersync", "sync"):
        module = StreamingPolicyModule(make_policy(), objective=objective, schedule=schedule)
        optimizer = module.configure_optimizers()
        for item in items:
            module.ingest(item)
        module.barrier(optimizer)
        directions.append(module.last_direction)
    streamed, sync = directions
    assert float((streamed - sync).norm() / sync.norm()) <= 1e-10
    if objective == "opd":
        turns = [i for i in items if isinstance(i, TurnSource)]
        closes = [i for i in items if isinstance(i, TrajectoryClosed)]
        assert len(closes) == 6 and sum(c.num_turn_sources for c in closes) == len(turns)
        for turn in turns:  # the teacher's scores are the frozen teacher's log-probs of exactly those tokens
            ids = turn.token_ids[None]
            with torch.no_grad():
                logits = teacher64(input_ids=ids).logits[0, :-1].log_softmax(-1)
            expected = logits.gather(-1, turn.token_ids[1:, None])[:, 0][turn.scored_mask[1:]]
            assert torch.allclose(turn.teacher_logprobs.double(), expected, atol=1e-6)


def test_every_source_carries_the_engine_version(tokenizer):
    dm = datamodule(tokenizer, version=4)
    items = list(dm.stream_update(0))
    assert items[0].policy_version == 4 and items[-1].policy_version == 4
    assert {r.policy_version for r in dm.ready_log} == {4}


def test_rollout_failure_surfaces_in_the_consumer(tokenizer):
    @contextlib.contextmanager
    def broken(task):
        raise OSError("sandbox unavailable")
        yield

    dm = RolloutDataModule(
        ScriptedEngine(tokenizer, REPLIES), tokenizer, TASKS, broken, prompts_per_update=1, samples_per_prompt=2
    )
    with pytest.raises(RuntimeError, match="sandbox unavailable"):
        list(dm.stream_update(0))


def test_bad_configuration_is_reported_at_once(tokenizer):
    with pytest.raises(ValueError) as error:
        RolloutDataModule(
            ScriptedEngine(tokenizer, REPLIES), tokenizer, [], attempt_factory(), "opd", prompts_per_update=0
        )
    message = str(error.value)
    assert "tasks is empty" in message and "prompts_per_update" in message and "teacher" in message


def test_train_dataloader_yields_consecutive_updates(tokenizer):
    dm = datamodule(tokenizer, updates=2)
    items = [item for update in dm.train_dataloader() for item in update]  # one lazy update per batch
    plans = [i for i in items if isinstance(i, BatchPlan)]
    assert len(plans) == 2 and sum(isinstance(i, BatchClosed) for i in items) == 2
    assert Objective(plans[0].objective) is Objective.GRPO


def _sources(items):
    return {
        (i.group_id, i.trajectory_index, getattr(i, "turn_index", None)): i for i in items if hasattr(i, "token_ids")
    }


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_each_rank_rolls_out_only_its_share_with_the_global_prompt_count(tokenizer, make_policy, teacher64, objective):
    """Two learner ranks split a batch (GRPO: whole groups; OPD: whole trajectories) and together hold exactly the
    single-rank batch; OPD's per-rank sums over the global N_k give the single-rank direction."""
    teacher = TeacherScorer(teacher64) if objective == "opd" else None
    try:
        whole = list(datamodule(tokenizer, objective, teacher).stream_update(0))
        shares = [
            list(datamodule(tokenizer, objective, teacher, rank=r, world_size=2).stream_update(0)) for r in (0, 1)
        ]
    finally:
        if teacher:
            teacher.close()
    plans = [share[0] for share in shares]
    assert all(plan.num_prompts == 2 for plan in plans)  # w = 1/(P·L_i) keeps the global P
    mine = [_sources(share) for share in shares]
    assert mine[0] and mine[1] and not set(mine[0]) & set(mine[1])
    assert set(mine[0]) | set(mine[1]) == set(_sources(whole))
    for key, source in {**mine[0], **mine[1]}.items():
        assert torch.equal(source.token_ids, _sources(whole)[key].token_ids)
    if objective == "grpo":
        assert [len(p.group_sizes) for p in plans] == [1, 1] and all(p.trajectories is None for p in plans)
        return
    owners = {(g, i): r for r, share in enumerate(mine) for (g, i, _) in share}
    assert sum(plan.num_trajectories for plan in plans) == 6 and len(owners) == 6
    sums, tokens = [], []
    for share in [whole, *shares]:
        module = StreamingPolicyModule(make_policy(), objective="opd")
        optimizer = module.configure_optimizers()
        for item in share:
            module.ingest(item)
        result = module.barrier(optimizer)  # one process: each share normalizes by its own N
        sums.append(module.last_direction * result.num_scored_tokens)
        tokens.append(result.num_scored_tokens)
    assert tokens[0] == tokens[1] + tokens[2]
    combined = (sums[1] + sums[2]) / tokens[0]
    assert float((combined - sums[0] / tokens[0]).norm() / (sums[0] / tokens[0]).norm()) <= 1e-10


def test_spread_groups_give_each_rank_a_share_of_every_group_with_the_same_samples(tokenizer):
    """GRPO under sharded statistics: every rank rolls out part of every group (round-robin), with the global m, and
    each trajectory is the one the single rank samples (same seed per group and index)."""
    whole = _sources(datamodule(tokenizer).stream_update(0))
    shares = []
    for r in (0, 1):
        module = datamodule(tokenizer)
        module.share_with(r, 2, spread_groups=True)
        shares.append(list(module.stream_update(0)))
    plans = [share[0] for share in shares]
    assert all(p.num_prompts == 2 and len(p.group_sizes) == 2 for p in plans)  # every group on every rank
    assert all(set(p.group_sizes.values()) == {3} for p in plans)  # the global m, for the advantage
    mine = [_sources(share) for share in shares]
    assert [len(m) for m in mine] == [3, 3] and not set(mine[0]) & set(mine[1])
    assert set(mine[0]) | set(mine[1]) == set(whole)
    for key, source in {**mine[0], **mine[1]}.items():
        assert torch.equal(source.token_ids, whole[key].token_ids)  # (the fake attempts hand out rewards in turn)
    for share, plan in zip(shares, plans, strict=True):
        closed = [i.group_id for i in share if isinstance(i, GroupClosed)]
        assert sorted(closed) == sorted(plan.group_sizes)  # each rank closes its part of every group


def test_rank_outside_the_world_is_reported(tokenizer):
    with pytest.raises(ValueError, match="rank must be in"):
        datamodule(tokenizer, rank=2, world_size=2)


def test_every_attempt_in_flight_gets_a_thread_for_its_tool_call(tokenizer):
    """16 attempts' tool calls block together (a barrier all 16 must reach): the default 6-thread executor of a
    2-core machine would serialize them, so a rollout finishing at all proves one thread per attempt in flight."""
    attempts = 16
    barrier = threading.Barrier(attempts, timeout=20)

    class BarrierAttempt(RecordingAttempt):
        def run_command(self, command: str):
            barrier.wait()  # BrokenBarrierError after 20 s if fewer threads than attempts
            return super().run_command(command)

    @contextlib.contextmanager
    def open_attempt(task):
        yield BarrierAttempt()

    replies = {i: ["<bash>ls</bash>", "<finish/>"] for i in range(4)}
    dm = RolloutDataModule(
        ScriptedEngine(tokenizer, replies),
        tokenizer,
        TASKS,
        open_attempt,
        "grpo",
        prompts_per_update=4,
        samples_per_prompt=4,
        run_seed=1,
        max_concurrent_attempts=attempts,
    )
    items = list(dm.stream_update(0))
    assert sum(isinstance(i, TrajectorySource) for i in items) == attempts
    assert not barrier.broken


def test_tool_threads_refuse_a_non_positive_concurrency():
    from tslightning.rollout.tool_threads import run_with_tool_threads

    async def nothing():
        return 1

    assert run_with_tool_threads(nothing(), 1) == 1
    with pytest.raises(ValueError, match="max_concurrent_attempts must be >= 1"):
        run_with_tool_threads(nothing(), 0)


def test_tool_threads_run_the_loop_and_its_tool_calls_on_the_given_cores():
    import asyncio
    import os

    from tslightning.rollout.tool_threads import run_with_tool_threads

    core = min(os.sched_getaffinity(0))

    async def where() -> tuple[set[int], set[int]]:
        return os.sched_getaffinity(0), await asyncio.to_thread(os.sched_getaffinity, 0)

    seen = {}
    thread = threading.Thread(target=lambda: seen.update(placed=run_with_tool_threads(where(), 2, [core])))
    thread.start()  # its own thread: placement is per thread, and pytest's stays as it was
    thread.join()
    assert seen["placed"] == ({core}, {core})
    with pytest.raises(ValueError, match="cpus None or non-empty"):
        run_with_tool_threads(where(), 2, [])


def test_train_dataloader_prefetches_no_rollout(tokenizer):
    """Each batch is an update's generator: fetching (as a Trainer prefetches) starts no rollout and stamps no plan."""
    dm = datamodule(tokenizer, updates=2)
    batches = iter(dm.train_dataloader())
    first, second = next(batches), next(batches)
    assert dm.update_starts == {} and dm.ready_log == []
    assert isinstance(next(first), BatchPlan) and sum(1 for _ in first) > 0
    assert dm.update_starts.keys() == {0}  # update 1 rolls out only once the learner starts it
    assert isinstance(next(second), BatchPlan)


def test_take_ready_hands_over_what_is_ready_without_waiting(tokenizer):
    dm = datamodule(tokenizer)
    stream = dm.stream_update(0)
    assert stream.take_ready() == []  # nothing runs before the plan is taken
    plan = next(stream)
    assert isinstance(plan, BatchPlan) and stream.take_ready() == []  # the rollout starts with the next request
    first = next(stream)
    items = [first]
    while not isinstance(items[-1], BatchClosed):
        time.sleep(0.05)  # a busy learner: everything finished meanwhile is handed over at once
        items += stream.take_ready() or [next(stream)]
    assert [type(i).__name__ for i in items].count("TrajectorySource") == 6 and isinstance(items[-1], BatchClosed)
    assert stream.take_ready() == [] and next(stream, None) is None


def test_a_failure_behind_ready_items_is_raised_by_the_next_call(tokenizer):
    from tslightning.rollout.continuous_rollout import RolloutFailure
    from tslightning.rollout.ready_items import ReadyItems

    plan = BatchPlan(Objective.GRPO, 0, {"g": 1})
    source = TrajectorySource("g", 0, torch.tensor([1, 2]), torch.tensor([False, True]), 1.0, 0, 1)

    def start():
        def begin(ready):
            for item in (source, RolloutFailure(OSError("replica died"))):
                ready.put(item)
            thread = threading.Thread(target=lambda: None)
            thread.start()
            return thread

        return plan, begin

    stream = ReadyItems(0, start)
    assert next(stream) is plan and next(stream) is source  # the producer starts with the first request after the plan
    with pytest.raises(RuntimeError, match="replica died"):
        stream.take_ready()


def test_a_busy_learner_serves_the_backlog_in_padded_passes_to_the_same_update(tokenizer, make_policy):
    """The Fabric loop's consumption (each item, then whatever else is ready) against per-item ingestion."""
    from tslightning.loop.updates import ready_now

    directions, passes = [], []
    for backlog in (False, True):
        dm = datamodule(tokenizer, delays={t.task_id: 0.05 * i for i, t in enumerate(TASKS)})
        module = StreamingPolicyModule(make_policy(), "grpo", "thundersync", micro_batch_size=4)
        optimizer = module.configure_optimizers()
        stream = dm.stream_update(0)
        for item in stream:
            ready = [item, *ready_now(stream)] if backlog else [item]
            time.sleep(0.2 if backlog else 0.0)  # each serving takes long enough for a backlog to form
            module.ingest_ready(ready)
        module.barrier(optimizer)
        directions.append(module.last_direction)
        passes.append(len({(r.start, r.end) for r in module.service_log}))
    assert torch.allclose(directions[0], directions[1], rtol=1e-5, atol=1e-7)
    assert passes[1] < passes[0] == 6
