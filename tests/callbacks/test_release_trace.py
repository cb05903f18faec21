"""ReleaseTraceRecorder: one JSONL record per served source and one per update, per rank, read back by read_trace."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from harness import SMALL, fit, grpo_batches, run_with_fabric_calls

from tslightning.callbacks import ReleaseTraceRecorder, read_trace
from tslightning.core.replay_batches import ReplayBatch, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.core.sources import TrajectorySource, TurnSource
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.rollout.rollout_datamodule import ReadyRecord


def _key(kind: str, group: str, trajectory: int, turn: int | None) -> tuple:
    return kind, group, trajectory, turn


def _source_key(item) -> tuple:
    return _key(type(item).__name__, item.group_id, item.trajectory_index, getattr(item, "turn_index", None))


def fake_datamodule(batch: ReplayBatch, update: int = 0) -> SimpleNamespace:
    """A datamodule's readiness record: item i became ready at 0.1·(i + 1) s; every group is one task."""
    log = [
        ReadyRecord(
            update=update,
            kind=type(item).__name__,
            group_id=getattr(item, "group_id", None),
            trajectory_index=getattr(item, "trajectory_index", None),
            turn_index=getattr(item, "turn_index", None),
            policy_version=batch.plan.policy_version,
            ready_time=0.1 * (i + 1),
        )
        for i, item in enumerate(batch.items)
    ]
    trajectories = [
        SimpleNamespace(
            task_id=f"task-of-{item.group_id}", group_id=item.group_id, trajectory_index=item.trajectory_index
        )
        for item in batch.items
        if isinstance(item, TrajectorySource) or (isinstance(item, TurnSource) and item.turn_index == 0)
    ]
    return SimpleNamespace(ready_log=log, trajectories={update: trajectories})


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_trace_under_fabric_with_datamodule_readiness(make_policy, teacher64, vocab_size, tmp_path, objective):
    generator = torch.Generator().manual_seed(3)
    if objective == "grpo":
        batch = synthetic_grpo_batch(vocab_size, 0, generator, SMALL)
    else:
        batch = synthetic_opd_batch(vocab_size, 0, generator, teacher64, SMALL)
    datamodule = fake_datamodule(batch)
    recorder = ReleaseTraceRecorder(tmp_path / "trace", datamodule=datamodule)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[recorder])
    module = StreamingPolicyModule(make_policy(), objective=objective)
    fabric_module, _ = fabric.setup(module, module.configure_optimizers())
    run_with_fabric_calls(fabric, fabric_module, batch, publication_s=0.25)

    path = tmp_path / "trace" / "trace-rank0.jsonl"
    records = read_trace(path)
    assert records == [json.loads(line) for line in path.read_text().splitlines()]
    assert read_trace(tmp_path / "trace") == records  # the directory form reads every rank's file
    *sources, update = records
    items = {_source_key(s): s for s in batch.items if isinstance(s, TrajectorySource | TurnSource)}
    ready = {_key(r.kind, r.group_id, r.trajectory_index, r.turn_index): r.ready_time for r in datamodule.ready_log}
    assert len(sources) == len(items) and {r["record"] for r in sources} == {"source"}
    starts = [r["service_start"] for r in sources]
    assert starts == sorted(starts) and all(0 <= r["service_start"] <= r["service_end"] for r in sources)
    for r in sources:
        key = _key(r["kind"], r["group"], r["trajectory"], r["turn"])
        item = items.pop(key)
        assert r["tokens"] == item.token_ids.numel() and r["scored_tokens"] == item.num_scored
        assert r["ready_time"] == ready[key] and r["task"] == f"task-of-{item.group_id}"
        assert r["policy_version"] == 0 and r["rank"] == 0 and r["update"] == 0 and r["deferred_completion"] is None
        assert r["turn"] is None if objective == "grpo" else isinstance(r["turn"], int)
    assert not items  # every source exactly once
    assert update == {
        "record": "update",
        "update": 0,
        "rank": 0,
        "rollout_close": datamodule.ready_log[-1].ready_time,  # BatchClosed's ready time R
        "learner_service_s": module.update_timings["learner_service_s"],
        "barrier_s": module.update_timings["barrier_s"],
        "publication_s": 0.25,
        "update_end": update["update_end"],
        "num_sources": len(sources),
    }
    assert update["update_end"] >= sources[-1]["service_end"]


def test_trace_under_a_trainer_appends_each_update(make_policy, vocab_size, tmp_path):
    """Without a datamodule τ_j is the service start and R the moment the learner saw BatchClosed."""
    batches = grpo_batches(vocab_size, 2)
    recorder = ReleaseTraceRecorder(tmp_path)
    fit(StreamingPolicyModule(make_policy()), batches, [recorder], tmp_path)
    records = read_trace(recorder.trace_file(0))
    for k, batch in enumerate(batches):
        *sources, update = [r for r in records if r["update"] == k]
        assert len(sources) == sum(isinstance(i, TrajectorySource) for i in batch.items)
        assert all(r["ready_time"] == r["service_start"] and r["policy_version"] == k for r in sources)
        assert update["record"] == "update" and update["publication_s"] == 0.0
        assert sources[-1]["service_end"] <= update["rollout_close"] <= update["update_end"]
    assert [r["update"] for r in records if r["record"] == "update"] == [0, 1]


def test_a_fresh_run_starts_a_fresh_trace_and_a_resumed_one_continues_its_checkpoint(make_policy, vocab_size, tmp_path):
    batches = grpo_batches(vocab_size, 3)
    old = tmp_path / "trace-rank0.jsonl"
    old.write_text('{"record": "update", "update": 7, "rank": 0}\n')  # an earlier run's trace in the same place
    recorder = ReleaseTraceRecorder(tmp_path)
    fit(StreamingPolicyModule(make_policy()), batches, [recorder], tmp_path)
    assert [r["update"] for r in read_trace(old) if r["record"] == "update"] == [0, 1, 2]
    assert recorder.state_dict() == {"next_update": 3}

    resumed = ReleaseTraceRecorder(tmp_path)
    resumed.load_state_dict({"next_update": 1})  # a checkpoint after update 0; updates 1 and 2 are redone
    module = StreamingPolicyModule(make_policy())
    module.policy_version = 1
    fit(module, batches, [resumed], tmp_path)
    updates = [r["update"] for r in read_trace(old) if r["record"] == "update"]
    assert (
        updates == [0, 1, 2]
        and sum(r["update"] == 1 for r in read_trace(old)) == 1 + SMALL.num_groups * SMALL.group_size
    )


def test_sources_carry_how_their_actions_were_generated(make_policy, vocab_size, tmp_path):
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(4), SMALL)
    datamodule = fake_datamodule(batch)
    for number, trajectory in enumerate(datamodule.trajectories[0]):
        record = {"generated_tokens": 10 + number, "generation_s": 0.5, "spec_steps": 3, "spec_drafted": 12}
        trajectory.generation_record = lambda turn, record=record: record | {"spec_accepted": 7}
    recorder = ReleaseTraceRecorder(tmp_path / "trace", datamodule=datamodule)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[recorder])
    module = StreamingPolicyModule(make_policy())
    fabric_module, _ = fabric.setup(module, module.configure_optimizers())
    run_with_fabric_calls(fabric, fabric_module, batch)
    sources = [r for r in read_trace(tmp_path / "trace") if r["record"] == "source"]
    assert sorted(r["generated_tokens"] for r in sources) == list(range(10, 10 + len(sources)))
    assert all(
        (r["spec_steps"], r["spec_drafted"], r["spec_accepted"], r["generation_s"]) == (3, 12, 7, 0.5) for r in sources
    )
