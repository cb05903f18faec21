"""Every callback on a plain LightningModule (automatic optimization, no streaming attributes) under a Trainer and under
a plain Fabric loop: it acts, or refuses naming what is missing — never silently nothing. Update boundaries, the
update index, the checked callback order and unique state keys."""

from __future__ import annotations

import csv
import math
import warnings

import lightning as L
import pytest
import torch
from harness import FakeEngine, MemoryLogger, PlainModule, fabric_plain_loop, fit_plain, plain_batches
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins import MixedPrecision

from tslightning import ServiceRecord
from tslightning.callbacks import (
    BatchBarrier,
    GPUClockCheckpoint,
    GradientClipping,
    MFUMonitor,
    ReleaseTraceRecorder,
    StalenessMonitor,
    UpdateCallback,
    WeightPublisher,
    read_trace,
)
from tslightning.core.sources import PolicyVersionError

HOSTS = ["trainer", "fabric"]


class Updates(UpdateCallback):
    """Records each update's index k at its start (what the host says) and end."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []

    def on_update_start(self, trainer, pl_module, batch) -> None:
        self.events.append(("start", self.current_index(trainer, pl_module)))

    def on_update_end(self, trainer, pl_module, k, batch) -> None:
        self.events.append(("end", k))


class SampledModule(PlainModule):
    """A plain module that records, per batch, which policy version sampled each of its rows (a ``service_log``)."""

    def __init__(self, lag: int = 0) -> None:
        super().__init__()
        self.lag = lag
        self.service_log: list[ServiceRecord] = []

    def on_train_batch_start(self, batch, batch_idx) -> None:
        version = self.trainer.global_step if self._trainer is not None else batch_idx
        self.service_log = [
            ServiceRecord("TrajectorySource", f"g{batch_idx}", i, None, max(version - self.lag, 0), 8, 4, 0.0, 0.0)
            for i in range(len(batch[0]))
        ]


def run(host: str, module, batches, callbacks, tmp_path, **trainer_args):
    if host == "trainer":
        return fit_plain(module, batches, callbacks, tmp_path, **trainer_args)
    return fabric_plain_loop(module, batches, callbacks, trainer_args.get("loggers", ()))


@pytest.mark.parametrize("host", HOSTS)
def test_a_plain_module_update_is_its_optimizer_step(host, tmp_path):
    updates = Updates()
    run(host, PlainModule(), plain_batches(3), [updates], tmp_path)
    assert updates.events == [("start", 0), ("end", 0), ("start", 1), ("end", 1), ("start", 2), ("end", 2)]


def test_gradient_accumulation_makes_one_update_of_several_batches(tmp_path):
    updates = Updates()
    fit_plain(PlainModule(), plain_batches(4), [updates], tmp_path, accumulate_grad_batches=2)
    assert updates.events == [("start", 0), ("end", 0), ("start", 1), ("end", 1)]


@pytest.mark.parametrize("host", HOSTS)
@pytest.mark.parametrize(
    ("callback", "missing"),
    [
        (lambda tmp: BatchBarrier(), "BatchBarrier has nothing to check on PlainModule: give the module a `registry`"),
        (lambda tmp: StalenessMonitor(), "StalenessMonitor needs the policy version .* `service_log`"),
        (lambda tmp: WeightPublisher(FakeEngine()), r"PlainModule has no `policy` module.*policy=lambda module"),
    ],
)
def test_a_callback_that_cannot_act_names_what_is_missing(host, callback, missing, tmp_path):
    module = PlainModule()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(ValueError, match=missing):
        run(host, module, plain_batches(2), [callback(tmp_path)], tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))  # refused before a step


@pytest.mark.parametrize("host", HOSTS)
def test_barrier_and_staleness_act_on_a_module_with_a_service_log(host, tmp_path):
    barrier, staleness = BatchBarrier(), StalenessMonitor()
    run(host, SampledModule(), plain_batches(3), [barrier, staleness], tmp_path)
    assert barrier.barriers_passed == 3 and staleness.histogram == {0: 12} and staleness.updates == 3
    module = SampledModule(lag=1)
    with pytest.raises(PolicyVersionError, match=r"source\(s\) served for update 1 carry another policy version"):
        run(host, module, plain_batches(3), [BatchBarrier()], tmp_path)


@pytest.mark.parametrize("host", HOSTS)
def test_gradient_clipping_on_a_plain_module_clips_and_logs_the_lightning_way(host, tmp_path):
    clipping = GradientClipping(max_norm=0.5)
    seen = []

    class Spy(L.Callback):  # after the clipping: the gradient the optimizer steps with
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads = [p.grad for p in pl_module.parameters()]
            seen.append(float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))))

    host_args = {}
    if host == "trainer":
        checkpoint = ModelCheckpoint(dirpath=tmp_path / "best", monitor="actor/grad_norm", mode="min", save_top_k=1)
        stopping = EarlyStopping(monitor="actor/grad_norm", mode="min", patience=100, check_on_train_epoch_end=True)
        host_args = dict(logger=CSVLogger(tmp_path, name="csv"), enable_checkpointing=True)
        trainer = run(
            host, PlainModule(), plain_batches(3), [clipping, Spy(), checkpoint, stopping], tmp_path, **host_args
        )
        assert float(trainer.callback_metrics["actor/grad_norm"]) == clipping.last_grad_norm  # float64, every digit
        assert float(checkpoint.best_model_score) == min(clipping.last_grad_norm, float(checkpoint.best_model_score))
        assert checkpoint.best_model_path and stopping.best_score is not None
        rows = list(csv.DictReader(next((tmp_path / "csv").rglob("metrics.csv")).open()))
        assert [int(r["step"]) for r in rows] == [0, 1, 2]  # one row per update, with the module's own self.log
        assert all(r["actor/grad_norm"] and r["train/loss"] for r in rows)
    else:
        logger = MemoryLogger()
        run(host, PlainModule(), plain_batches(3), [clipping, Spy()], tmp_path, loggers=[logger])
        assert [step for step, _ in logger.logged] == [0, 1, 2]
        assert logger.logged[-1][1]["actor/grad_norm"] == clipping.last_grad_norm
    assert clipping.updates == 3 and clipping.clipped_updates == 3
    assert seen == pytest.approx([0.5] * 3, rel=1e-5)  # clipped to max_norm (coefficient 0.5 / (norm + 1e-6))


def test_double_clipping_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"Trainer\(gradient_clip_val=0.5\) clips too; keep one of the two"):
        fit_plain(PlainModule(), plain_batches(1), [GradientClipping()], tmp_path, gradient_clip_val=0.5)
    with pytest.raises(ValueError, match="another GradientClipping is registered"):
        fabric_plain_loop(PlainModule(), plain_batches(1), [GradientClipping(1.0), GradientClipping(2.0)])


class Overflowing(PlainModule):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch, batch_idx) * torch.tensor(float("inf"), dtype=torch.float64)


def test_a_grad_scaler_overflow_step_is_skipped_as_lightning_does(tmp_path):
    module, clipping = Overflowing(), GradientClipping()
    before = [p.detach().clone() for p in module.parameters()]
    scaler = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    fit_plain(module, plain_batches(2), [clipping], tmp_path, plugins=[scaler])
    assert clipping.skipped_updates == 2 and clipping.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    with pytest.raises(FloatingPointError, match=r"update 0 \(θ_0 → θ_1\) has a non-finite global norm"):
        fit_plain(Overflowing(), plain_batches(1), [GradientClipping()], tmp_path)


@pytest.mark.parametrize("host", HOSTS)
def test_weight_publisher_publishes_a_plain_modules_model_through_an_accessor(host, tmp_path):
    engine, module = FakeEngine(), PlainModule()
    publisher = WeightPublisher(engine, policy=lambda m: m.layer)
    run(host, module, plain_batches(3), [publisher], tmp_path)
    assert [version for version, _ in engine.published] == [1, 2, 3]
    assert torch.equal(engine.published[-1][1]["weight"], module.layer.weight.detach())
    assert publisher.last_publication.policy_version == 3


@pytest.mark.parametrize("host", HOSTS)
def test_mfu_monitor_takes_flops_per_batch_like_throughput_monitor(host, tmp_path):
    class Counted(PlainModule):
        flops_per_batch = 6 * 5 * 4  # 6 · parameters · rows

    monitor = MFUMonitor(available_flops=1e9)
    run(host, Counted(), plain_batches(2), [monitor], tmp_path)
    assert [m.learner_flops for m in monitor.history] == [120.0, 120.0]
    assert all(m.mfu == 120.0 / (m.step_s * 1e9) and m.learner_service_s is None for m in monitor.history)

    silent = MFUMonitor(available_flops=1e9)
    with pytest.warns(UserWarning, match=r"no FLOP count for PlainModule: pass MFUMonitor\(flops_fn=...\)") as caught:
        run(host, PlainModule(), plain_batches(2), [silent], tmp_path)
    assert sum("no FLOP count" in str(w.message) for w in caught) == 1  # once
    assert [m.mfu for m in silent.history] == [None, None] and all(m.step_s > 0 for m in silent.history)
    counted = MFUMonitor(available_flops=1e9, flops_fn=lambda module: 10.0)
    run(host, PlainModule(), plain_batches(1), [counted], tmp_path)
    assert counted.history[0].learner_flops == 10.0


@pytest.mark.parametrize("host", HOSTS)
def test_release_trace_of_a_plain_module_warns_and_writes_update_records(host, tmp_path):
    recorder = ReleaseTraceRecorder(tmp_path / "trace")
    with pytest.warns(UserWarning, match="has no `service_log`: the trace gets update records only"):
        run(host, PlainModule(), plain_batches(2), [recorder], tmp_path)
    assert [(r["record"], r["update"]) for r in read_trace(tmp_path / "trace")] == [("update", 0), ("update", 1)]


@pytest.mark.parametrize("host", HOSTS)
def test_readers_of_the_publication_refuse_to_come_before_the_publisher(host, tmp_path):
    publisher = WeightPublisher(FakeEngine(), policy=lambda m: m.layer)
    for reader in (MFUMonitor(available_flops=1e9), ReleaseTraceRecorder(tmp_path / "t"), GPUClockCheckpoint(tmp_path)):
        with pytest.raises(ValueError, match=f"{type(reader).__name__} comes before WeightPublisher.* (after|last)"):
            run(host, PlainModule(), plain_batches(1), [reader, publisher], tmp_path)


@pytest.mark.parametrize("host", HOSTS)
def test_publication_time_reaches_every_reader(host, tmp_path):
    publisher = WeightPublisher(FakeEngine(), policy=lambda m: m.layer)
    monitor, recorder = MFUMonitor(available_flops=1e9), ReleaseTraceRecorder(tmp_path / "trace")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run(host, PlainModule(), plain_batches(2), [publisher, monitor, recorder], tmp_path)
    seconds = publisher.last_publication.seconds
    assert monitor.history[-1].publication_s == seconds > 0
    assert read_trace(tmp_path / "trace")[-1]["publication_s"] == seconds


def test_the_checkpoint_must_follow_the_callbacks_whose_state_it_saves(tmp_path):
    with pytest.raises(
        ValueError, match="GPUClockCheckpoint comes before StalenessMonitor.* put GPUClockCheckpoint last"
    ):
        fabric_plain_loop(SampledModule(), plain_batches(1), [GPUClockCheckpoint(tmp_path), StalenessMonitor()])


def test_several_instances_need_distinct_state_keys(tmp_path):
    twins = [ReleaseTraceRecorder(tmp_path / "a"), ReleaseTraceRecorder(tmp_path / "b")]
    with pytest.raises(ValueError, match=r"2 callbacks share state_key 'ReleaseTraceRecorder'.*distinct name="):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fabric_plain_loop(PlainModule(), plain_batches(1), twins)
    named = [ReleaseTraceRecorder(tmp_path / "a", name="a"), ReleaseTraceRecorder(tmp_path / "b", name="b")]
    publishers = [WeightPublisher(FakeEngine(), policy=lambda m: m.layer, name=n) for n in ("x", "y")]
    checkpoints = [GPUClockCheckpoint(tmp_path / n, name=n) for n in ("c", "d")]
    monitors = [MFUMonitor(1e9, flops_fn=lambda m: 1.0, name=n) for n in ("e", "f")]
    keys = {cb.state_key for cb in [*named, *publishers, *checkpoints, *monitors]}
    assert len(keys) == 8
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fabric_plain_loop(PlainModule(), plain_batches(1), [*publishers, *named, *monitors, *checkpoints])
    assert all(p.publications == 1 for p in publishers) and all(c.checkpoints_written == 1 for c in checkpoints)
    assert not math.isnan(monitors[0].history[0].step_s)


def test_a_fabric_loop_without_on_before_optimizer_step_still_ends_updates_or_is_told(tmp_path):
    """The optimizer's step hook ends each update; a callback that acts before the step refuses to be skipped."""
    staleness = StalenessMonitor()
    fabric_plain_loop(SampledModule(), plain_batches(3), [staleness], before_step=False)
    assert staleness.updates == 3
    for callback in (GradientClipping(), BatchBarrier()):
        with pytest.raises(ValueError, match=r"stepped without on_before_optimizer_step.*fabric.call\(\"on_before_opt"):
            fabric_plain_loop(SampledModule(), plain_batches(1), [callback], before_step=False)
