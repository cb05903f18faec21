"""GPUClockCheckpoint: due after interval / devices of wall clock, written only at BatchClosed, atomic, complete
meta.json, pruned, and restorable — under a Lightning Trainer and under Fabric, with a patched clock."""

from __future__ import annotations

import json
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from harness import HOSTS, FakeEngine, fit, grpo_batches
from peft import LoraConfig, get_peft_model

from tslightning.callbacks import GPUClockCheckpoint, WeightPublisher
from tslightning.callbacks.checkpoint_state import (
    CheckpointError,
    checkpoint_dirs,
    checkpoint_files,
    policy_hash,
    read_meta,
    restore_checkpoint,
)
from tslightning.callbacks.gpu_clock_checkpoint import TRAINER_META_KEY
from tslightning.core.replay_batches import ReplayBatch
from tslightning.core.sources import BatchClosed, TrajectorySource
from tslightning.learner.streaming_module import OptimizerSettings, StreamingPolicyModule

META_FIELDS = {
    "format_version",
    "seed",
    "update",
    "next_update",
    "policy_version",
    "policy_hash",
    "published_at",
    "publication_s",
    "trajectories_seen",
    "scored_tokens_seen",
    "gpu_clock_s",
    "devices",
    "written_at",
    "state_file",
    "layout",
    "strategy",
    "world_size",
    "config",
}


class FakeClock:
    """``time.monotonic`` stand-in; tests move ``now``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timeline(L.Callback):
    """Sets the clock as each stream item starts: ``times[i]`` for the i-th item of the run (carried forward); and
    records, at each item's start, what the previous item's end left: whether a checkpoint is due and which exist.
    In a loop feeding one item per batch it acts at ``on_train_batch_start``; under a Trainer (one update per batch)
    the module calls :meth:`before_item` as it ingests each item (:class:`ClockedModule`)."""

    def __init__(self, clock: FakeClock, times: dict[int, float], checkpointer: GPUClockCheckpoint) -> None:
        self.clock, self.times, self.checkpointer = clock, times, checkpointer
        self.item = 0
        self.seen: list[tuple[int, bool, list[str]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not isinstance(batch, list):
            self.before_item()

    def before_item(self) -> None:
        names = [p.name for p in checkpoint_dirs(self.checkpointer.dirpath)]
        names += [path.rsplit("/", 1)[-1].removesuffix(".ckpt") for path in checkpoint_files(self.checkpointer.dirpath)]
        self.seen.append((self.item, self.checkpointer.due, names))
        self.clock.now = self.times.get(self.item, self.clock.now)
        self.item += 1


class ClockedModule(StreamingPolicyModule):
    """Moves the Timeline as each stream item arrives inside a Trainer batch."""

    timeline: Timeline | None = None

    def ingest(self, item) -> None:
        if self.timeline is not None:
            self.timeline.before_item()
        super().ingest(item)


def run_updates(host: str, module, batches: list[ReplayBatch], callbacks, tmp_path):
    """Each batch as one update, every stream item through the batch hooks: a Trainer, or a Fabric loop doing what a
    Trainer does (keywords: fabric.setup registers the LightningModule as a callback too). Returns the optimizer."""
    if host == "trainer":
        return fit(module, batches, callbacks, tmp_path, enable_checkpointing=None).optimizers[0]
    items = [item for batch in batches for item in batch.stream()]
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=callbacks)
    wrapped, optimizer = fabric.setup(module, module.configure_optimizers())
    fabric.call("on_train_start", trainer=fabric, pl_module=wrapped)
    for index, item in enumerate(items):
        fabric.call("on_train_batch_start", trainer=fabric, pl_module=wrapped, batch=item, batch_idx=index)
        wrapped.ingest(item)
        if isinstance(item, BatchClosed):
            wrapped.barrier(optimizer)
        fabric.call("on_train_batch_end", trainer=fabric, pl_module=wrapped, outputs=None, batch=item, batch_idx=index)
    fabric.call("on_train_end", trainer=fabric, pl_module=wrapped)
    return optimizer


def new_module(make_policy, module_class=StreamingPolicyModule) -> StreamingPolicyModule:
    return module_class(make_policy(), optimizer=OptimizerSettings(lr=1e-3))


@pytest.mark.parametrize("host", HOSTS)
def test_due_after_interval_over_devices_written_at_the_next_batch_closed(make_policy, vocab_size, host, tmp_path):
    batches = grpo_batches(vocab_size, 2)
    first_update_items = 1 + len(batches[0].items)
    clock = FakeClock()
    checkpointer = GPUClockCheckpoint(
        tmp_path / "ckpt", interval_s=3600.0, devices=2, clock=clock, seed=7, config={"seed": 7, "updates": 2}
    )
    # Update 0 ends at 1799 s of wall clock (3598 GPU-s: not due); update 1's first source arrives at 1800 s.
    timeline = Timeline(clock, {first_update_items - 1: 1799.0, first_update_items + 1: 1800.0}, checkpointer)
    publisher = WeightPublisher(FakeEngine())
    module = new_module(make_policy, ClockedModule)
    module.timeline = timeline if host == "trainer" else None
    optimizer = run_updates(host, module, batches, [timeline, publisher, checkpointer], tmp_path)

    due = [(item, names) for item, is_due, names in timeline.seen if is_due]
    assert due[0] == (first_update_items + 2, [])  # requested mid-update 1, nothing written before its BatchClosed
    assert all(names == [] for _, names in due)  # ... through the last item of update 1
    assert not checkpointer.due and checkpointer.checkpoints_written == 1
    sources = [item for batch in batches for item in batch.items if isinstance(item, TrajectorySource)]
    if host == "trainer":  # Lightning's own file, through trainer.save_checkpoint; the meta record rides inside
        (written,) = checkpoint_files(checkpointer.dirpath)  # save_last: update 1 has one
        assert written.endswith("/update-1.ckpt") and checkpointer.last_checkpoint_path == written
        checkpoint = torch.load(written, weights_only=False)
        meta = checkpoint[TRAINER_META_KEY]
        assert checkpoint["global_step"] == 2 and checkpoint["streaming_policy_module"]["policy_version"] == 2
        assert checkpoint["callbacks"][publisher.state_key] == {"published_version": 2, "publications": 2}
        saved = checkpoint["state_dict"]
        assert all(torch.equal(saved[n], p) for n, p in module.state_dict().items())
        assert list(tmp_path.rglob("epoch=0-step=2.ckpt")), "the default ModelCheckpoint still writes"
    else:
        assert [p.name for p in checkpoint_dirs(checkpointer.dirpath)] == ["update-1"]  # save_last: update 1 has one
        meta = read_meta(checkpointer.dirpath / "update-1")
    assert set(meta) == META_FIELDS
    assert meta["update"] == 1 and meta["next_update"] == 2 and meta["policy_version"] == 2
    assert meta["seed"] == 7 and meta["config"] == {"seed": 7, "updates": 2}
    assert meta["gpu_clock_s"] == 3600.0 and meta["devices"] == 2
    assert meta["trajectories_seen"] == len(sources) == 12
    assert meta["scored_tokens_seen"] == sum(s.num_scored for s in sources)
    assert meta["policy_hash"] == policy_hash(module.policy)
    assert meta["publication_s"] == module.update_timings["publication_s"]
    assert meta["written_at"] >= meta["published_at"] > 1.7e9  # Unix seconds
    if host == "trainer":
        return

    restored = new_module(make_policy)
    restored_optimizer = restored.configure_optimizers()
    point = restore_checkpoint(checkpointer.dirpath / "update-1", restored, [restored_optimizer])
    assert (point.next_update, point.policy_version) == (2, 2) and restored.num_optimizer_steps == 2
    assert all(torch.equal(a, b) for a, b in zip(restored.parameters(), module.parameters(), strict=True))
    expected, actual = optimizer.state_dict()["state"], restored_optimizer.state_dict()["state"]
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[i]["exp_avg_sq"], actual[i]["exp_avg_sq"]) for i in expected)


def test_config_path_is_read_when_writing_and_callback_states_are_saved(make_policy, vocab_size, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"seed": 3, "objective": "grpo"}))
    checkpointer = GPUClockCheckpoint(tmp_path / "ckpt", clock=FakeClock(), config=config)
    publisher = WeightPublisher(FakeEngine())
    run_updates("fabric", new_module(make_policy), grpo_batches(vocab_size, 1), [publisher, checkpointer], tmp_path)

    meta = read_meta(tmp_path / "ckpt" / "update-0")  # not due on the clock: save_last wrote it
    assert meta["config"] == {"seed": 3, "objective": "grpo"} and meta["seed"] == 3
    state = torch.load(tmp_path / "ckpt" / "update-0" / "state.pt", weights_only=True)
    assert state["callbacks"][publisher.state_key] == {"published_version": 1, "publications": 1}
    assert state["callbacks"][checkpointer.state_key]["last_checkpoint_update"] == 0
    assert state["next_update"] == 1 and (tmp_path / "ckpt" / "update-0" / "rng-rank0.pt").is_file()

    publisher_again, checkpointer_again = WeightPublisher(FakeEngine()), GPUClockCheckpoint(tmp_path / "other")
    module = new_module(make_policy)
    callbacks = [publisher_again, checkpointer_again]
    restore_checkpoint(tmp_path / "ckpt" / "update-0", module, [module.configure_optimizers()], callbacks)
    assert publisher_again.published_version == 1
    assert checkpointer_again.trajectories_seen == meta["trajectories_seen"]
    assert checkpointer_again.last_checkpoint_update == 0


def test_a_failed_write_leaves_no_directory_and_stays_due(make_policy, vocab_size, tmp_path, monkeypatch):
    checkpointer = GPUClockCheckpoint(tmp_path / "ckpt", clock=FakeClock(), save_last=False)
    checkpointer.request()
    real_save, calls = torch.save, []

    def save_then_fail(obj, file, *args, **kwargs):
        calls.append(getattr(file, "name", "a buffer"))  # the state goes through CheckpointIO via a buffer
        assert any(p.name == ".tmp-update-0" for p in (tmp_path / "ckpt").iterdir())
        if len(calls) == 2:  # the RNG file is written; the model state fails half-way through the directory
            raise OSError("No space left on device")
        real_save(obj, file, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save_then_fail)
    with pytest.raises(RuntimeError, match=r"writing .*update-0 failed: OSError: No space left on device"):
        run_updates("fabric", new_module(make_policy), grpo_batches(vocab_size, 1), [checkpointer], tmp_path)
    assert list((tmp_path / "ckpt").iterdir()) == []
    assert checkpointer.due and checkpointer.checkpoints_written == 0 and checkpointer.last_checkpoint_update is None


def test_keep_last_prunes_and_a_stale_directory_is_replaced(make_policy, vocab_size, tmp_path):
    clock = FakeClock()
    checkpointer = GPUClockCheckpoint(tmp_path / "ckpt", interval_s=10.0, keep_last=2, clock=clock)
    stale = tmp_path / "ckpt" / "update-3"
    stale.mkdir(parents=True)
    (stale / "from-an-abandoned-run").touch()
    timeline = Timeline(clock, {i: 100.0 * i for i in range(100)}, checkpointer)  # every update is due
    run_updates("fabric", new_module(make_policy), grpo_batches(vocab_size, 4), [timeline, checkpointer], tmp_path)

    assert [p.name for p in checkpoint_dirs(tmp_path / "ckpt")] == ["update-2", "update-3"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["update-2", "update-3"]  # no .tmp-/.stale-
    assert not (stale / "from-an-abandoned-run").exists() and read_meta(stale)["update"] == 3
    assert checkpointer.checkpoints_written == 4


def test_rank_zero_decides_for_every_rank(tmp_path, monkeypatch):
    """On rank 1, a local request is ignored when rank 0 says no, and rank 0's yes is followed without one."""
    written = []
    monkeypatch.setattr(GPUClockCheckpoint, "save", lambda self, trainer, module: written.append(trainer.global_rank))
    module = SimpleNamespace(service_log=[], update_timings={}, num_optimizer_steps=1)
    for rank_zero_says, local_request in [(False, True), (True, False)]:
        strategy = SimpleNamespace(
            broadcast=lambda obj, src=0, decision=rank_zero_says: decision,
            all_reduce=lambda tensor, reduce_op="sum": tensor * 2,
            root_device=torch.device("cpu"),
        )
        trainer = SimpleNamespace(strategy=strategy, global_rank=1, world_size=2)
        checkpointer = GPUClockCheckpoint(tmp_path, clock=FakeClock())
        if local_request:
            checkpointer.request()
        checkpointer.on_train_start(trainer, module)
        checkpointer.on_train_batch_end(trainer, module, None, BatchClosed(0), 0)
    assert written == [1]


def test_state_dict_round_trip_continues_the_gpu_clock(tmp_path):
    clock = FakeClock()
    trainer = SimpleNamespace(world_size=4)
    first = GPUClockCheckpoint(tmp_path, interval_s=3600.0, clock=clock)
    first.on_train_start(trainer, None)
    clock.now = 500.0
    first.trajectories_seen, first.scored_tokens_seen, first.last_checkpoint_gpu_s = 10, 200, 1000.0
    state = first.state_dict()
    assert state["gpu_clock_s"] == 2000.0  # 500 s × 4 devices

    second = GPUClockCheckpoint(tmp_path, interval_s=3600.0, clock=clock)
    second.load_state_dict(state)
    assert second.gpu_clock_s == 2000.0 and not second.due  # the downtime between runs is not training
    clock.now = 10_000.0
    second.on_train_start(trainer, None)
    clock.now += 650.0
    assert second.gpu_clock_s == 2000.0 + 650.0 * 4 and second.due  # 3600 GPU-s since the checkpoint at 1000
    assert (second.trajectories_seen, second.scored_tokens_seen) == (10, 200)
    assert second.state_key == first.state_key == "GPUClockCheckpoint"


def test_settings_are_validated_together(tmp_path):
    with pytest.raises(ValueError, match=r"interval_s must be > 0.*devices must be.*keep_last must be"):
        GPUClockCheckpoint(tmp_path, interval_s=0, devices=0, keep_last=0)


def test_a_lora_policy_resumes_with_its_adapters(make_policy, vocab_size, tmp_path):
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    module = StreamingPolicyModule(get_peft_model(make_policy(), config), optimizer=OptimizerSettings(lr=1e-3))
    checkpointer = GPUClockCheckpoint(tmp_path / "ckpt", clock=FakeClock())
    run_updates("fabric", module, grpo_batches(vocab_size, 1), [checkpointer], tmp_path)

    fresh = StreamingPolicyModule(get_peft_model(make_policy(), config), optimizer=OptimizerSettings(lr=1e-3))
    assert policy_hash(fresh.policy) != policy_hash(module.policy)
    restore_checkpoint(tmp_path / "ckpt" / "update-0", fresh, [fresh.configure_optimizers()])
    assert (
        policy_hash(fresh.policy)
        == policy_hash(module.policy)
        == read_meta(tmp_path / "ckpt" / "update-0")["policy_hash"]
    )
    assert all(
        torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), module.state_dict().values(), strict=True)
    )


def test_takes_deepspeed_and_fsdp2_whose_ranks_write_their_shards_but_refuses_fsdp1(tmp_path):
    """DeepSpeed and FSDP2 (ModelParallelStrategy) are written as sharded layouts (tests/distributed/
    test_sharded_resume.py writes and resumes them); Fabric's FSDP1 strategy stays refused."""
    pytest.importorskip("deepspeed")
    from lightning.fabric.strategies import FSDPStrategy

    from tslightning.distributed.learner_strategy import LearnerSettings, learner_strategy

    for strategy in ("deepspeed_stage_2", "deepspeed_stage_3", "fsdp"):
        callback = GPUClockCheckpoint(tmp_path, 3600.0)
        trainer = SimpleNamespace(world_size=2, strategy=learner_strategy(LearnerSettings(2, strategy=strategy), "cpu"))
        callback.on_train_start(trainer, None)
        assert callback._world_devices == 2
    with pytest.raises(ValueError, match="Fabric's FSDPStrategy \\(FSDP1\\) shards state this checkpoint cannot hold"):
        GPUClockCheckpoint(tmp_path, 3600.0).on_train_start(
            SimpleNamespace(world_size=2, strategy=FSDPStrategy()), None
        )


def test_trainer_resumes_from_an_update_checkpoint_with_ckpt_path(make_policy, vocab_size, tmp_path):
    """trainer.fit(ckpt_path=<update-k>.ckpt) restores θ, AdamW, the policy version, global step and the callbacks'
    states (the GPU-clock continues); the resumed run's next update equals the uninterrupted run's."""
    batches = grpo_batches(vocab_size, 3)
    straight = new_module(make_policy)
    fit(
        straight,
        batches,
        [WeightPublisher(FakeEngine()), GPUClockCheckpoint(tmp_path / "a", clock=FakeClock())],
        tmp_path,
    )

    clock = FakeClock()
    first = GPUClockCheckpoint(tmp_path / "b", interval_s=10.0, clock=clock, keep_last=1)
    first.request()
    fit(new_module(make_policy), batches, [WeightPublisher(FakeEngine()), first], tmp_path, max_steps=2)
    (written,) = checkpoint_files(tmp_path / "b")  # update-0 (requested) was pruned after update-1 (save_last)
    assert written.endswith("update-1.ckpt") and first.checkpoints_written == 2

    clock.now = 5.0
    engine, resumed_checkpointer, module = (
        FakeEngine(),
        GPUClockCheckpoint(tmp_path / "b", clock=clock),
        new_module(make_policy),
    )
    callbacks = [WeightPublisher(engine), resumed_checkpointer]
    trainer = fit(module, batches, callbacks, tmp_path, max_steps=3, ckpt_path=written)
    assert trainer.global_step == 3 and module.policy_version == 3 and module.num_optimizer_steps == 3
    assert [version for version, _ in engine.published] == [2, 3]  # restored θ_2 first, then update 2's θ_3
    assert resumed_checkpointer.checkpoints_written == 3 and resumed_checkpointer.trajectories_seen == 3 * 6
    assert torch.equal(module.layout.values(), straight.layout.values())


def test_trainer_writes_through_checkpoint_io_to_an_fsspec_path(make_policy, vocab_size, tmp_path):
    checkpointer = GPUClockCheckpoint("memory://gpu-clock/run", clock=FakeClock(), keep_last=2)
    checkpointer.request()
    fit(new_module(make_policy), grpo_batches(vocab_size, 3), [checkpointer], tmp_path)
    written = checkpoint_files("memory://gpu-clock/run")  # fsspec's in-memory filesystem
    assert written == ["memory://gpu-clock/run/update-0.ckpt", "memory://gpu-clock/run/update-2.ckpt"]  # request, last
    with pytest.raises(ValueError, match="is a URL; a Fabric loop writes a local path"):
        run_updates("fabric", new_module(make_policy), grpo_batches(vocab_size, 1), [checkpointer], tmp_path)


def test_a_corrupt_state_file_names_the_file(make_policy, vocab_size, tmp_path):
    run_updates(
        "fabric", new_module(make_policy), grpo_batches(vocab_size, 1), [GPUClockCheckpoint(tmp_path)], tmp_path
    )
    state = tmp_path / "update-0" / "state.pt"
    data = state.read_bytes()
    for damaged in (data[: len(data) // 2], b"", b"not a checkpoint"):
        state.write_bytes(damaged)
        with pytest.raises(
            CheckpointError, match=rf"resume: cannot read {state} \(.*\); the file is truncated or corrupt"
        ) as info:
            restore_checkpoint(tmp_path / "update-0", new_module(make_policy), [torch.optim.SGD([torch.zeros(1)], 0.1)])
        assert "\n" not in str(info.value)
    torch.save({"state_dict": {}}, state)
    with pytest.raises(CheckpointError, match=rf"{state} lacks optimizer_states, callbacks, policy_version"):
        restore_checkpoint(tmp_path / "update-0", new_module(make_policy), [])
