"""MFUMonitor: Eq. 10 per update with the verl breakdown, under direct hooks, a Trainer and Fabric; peak resolution."""

from __future__ import annotations

import time
import warnings
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from harness import MemoryLogger, fit, grpo_batch, grpo_batches, run_with_fabric_calls

from tslightning.callbacks import MFUMonitor
from tslightning.callbacks.peak_flops import dense_peak_flops
from tslightning.core.replay_batches import ReplayBatch
from tslightning.core.sources import BatchClosed, TrajectorySource
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.learner.update_log import write_update_row
from tslightning.measure.learner_flops import DecoderShape, learner_flops

PEAK = 1e12  # FLOP/s per device (a CPU has no entry in Lightning's table); above what the tiny updates reach


def expected_flops(module: StreamingPolicyModule, batch: ReplayBatch) -> int:
    """F_k^train from the batch itself: every trajectory's full token count (its scored rows through the LM head),
    full fine-tuning."""
    shape = DecoderShape.from_config(module.policy.config)
    sources = [s for s in batch.items if isinstance(s, TrajectorySource)]
    return sum(learner_flops(shape, s.token_ids.numel(), scored_tokens=s.num_scored) for s in sources)


def batch_tokens(batch: ReplayBatch) -> int:
    return sum(s.token_ids.numel() for s in batch.items if isinstance(s, TrajectorySource))


def _at(monkeypatch: pytest.MonkeyPatch, now: float, hook, *args) -> None:
    """Call ``hook`` with ``time.perf_counter`` frozen at ``now``."""
    with monkeypatch.context() as patch:
        patch.setattr(time, "perf_counter", lambda: now)
        hook(*args)


@pytest.mark.parametrize("rollout_wait_s", [None, 7.0])
def test_exact_mfu_and_breakdown_of_a_synthetic_update(make_policy, vocab_size, monkeypatch, rollout_wait_s):
    logger = MemoryLogger()
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[logger])
    monitor = MFUMonitor(available_flops=PEAK)
    module = StreamingPolicyModule(make_policy())
    batch = grpo_batch(vocab_size)

    _at(monkeypatch, 100.0, monitor.on_train_batch_start, fabric, module, batch.plan, 0)
    for item in batch.stream():
        module.ingest(item)
    module.barrier(module.configure_optimizers())
    # The phases as the module, the loop and the WeightPublisher would have recorded them.
    module.update_timings.update(learner_service_s=3.0, barrier_s=0.5, publication_s=1.0)
    if rollout_wait_s is not None:
        module.update_timings["rollout_wait_s"] = rollout_wait_s
    _at(monkeypatch, 112.5, monitor.on_train_batch_end, fabric, module, None, BatchClosed(0), len(batch.items))
    write_update_row(fabric)  # what the Fabric loop does after the update's on_train_batch_end

    (measurement,) = monitor.history
    flops, tokens = expected_flops(module, batch), batch_tokens(batch)
    assert measurement.learner_flops == flops and measurement.num_tokens == tokens
    assert measurement.mfu == flops / (12.5 * PEAK * 1)
    assert measurement.metrics() == {
        "timing_s/step": 12.5,
        "timing_s/gen": 8.0 if rollout_wait_s is None else rollout_wait_s,  # 12.5 − 3 − 0.5 − 1
        "timing_s/update_actor": 3.0,
        "timing_s/barrier": 0.5,
        "timing_s/update_weights": 1.0,
        "perf/mfu/actor": flops / (12.5 * PEAK),
        "perf/total_num_tokens": float(tokens),
        "perf/throughput": tokens / 12.5,
    }
    ((step, logged),) = logger.logged
    assert step == 0 and logged == {**measurement.metrics(), "perf/mfu/actor_avg": measurement.mfu}


def _check_real_update(monitor: MFUMonitor, module: StreamingPolicyModule, batch: ReplayBatch) -> None:
    (m,) = monitor.history
    assert m.learner_flops == expected_flops(module, batch) and m.num_tokens == batch_tokens(batch)
    assert m.step_s > 0 and m.learner_service_s > 0 and m.barrier_s > 0 and m.rollout_wait_s >= 0
    assert m.rollout_wait_s + m.learner_service_s + m.barrier_s + m.publication_s == pytest.approx(m.step_s)
    assert m.mfu == m.learner_flops / (m.step_s * PEAK)
    assert monitor.mean_step_time() == m.step_s and monitor.mean_mfu() == m.mfu


def test_under_a_trainer(make_policy, vocab_size, tmp_path):
    monitor, module, batch = MFUMonitor(PEAK), StreamingPolicyModule(make_policy()), grpo_batch(vocab_size)
    fit(module, [batch], [monitor], tmp_path)
    _check_real_update(monitor, module, batch)


def test_under_fabric_call(make_policy, vocab_size):
    monitor = MFUMonitor(available_flops=PEAK)
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[monitor])
    module, batch = StreamingPolicyModule(make_policy()), grpo_batch(vocab_size)
    fabric_module, _ = fabric.setup(module, module.configure_optimizers())
    run_with_fabric_calls(fabric, fabric_module, batch)
    _check_real_update(monitor, module, batch)


def test_cpu_without_available_flops_logs_no_mfu_and_warns_once(make_policy, vocab_size, tmp_path):
    """No table knows a CPU's peak: training goes on, step times are logged, MFU is left out, one warning says so."""
    monitor, module, batches = MFUMonitor(), StreamingPolicyModule(make_policy()), grpo_batches(vocab_size, 2)
    with pytest.warns(
        UserWarning, match=r"no peak FLOP/s known for 'cpu'.*MFUMonitor\(available_flops=\.\.\.\)"
    ) as seen:
        fit(module, batches, [monitor], tmp_path)
    assert len([w for w in seen if "peak FLOP/s" in str(w.message)]) == 1
    assert module.policy_version == 2 and [m.mfu for m in monitor.history] == [None, None]
    assert all(m.step_s > 0 and m.learner_flops > 0 for m in monitor.history)
    assert "perf/mfu/actor" not in monitor.history[-1].metrics()


class _OnCuda:
    """A Fabric seen as if its root device were ``cuda:0`` (name and synchronisation faked by the test)."""

    def __init__(self, fabric: L.Fabric) -> None:
        self._fabric = fabric
        self.strategy = SimpleNamespace(root_device=torch.device("cuda", 0), precision=fabric.strategy.precision)

    def __getattr__(self, name: str):
        return getattr(self._fabric, name)


def _update_on(monkeypatch, device_name: str, make_policy, vocab_size, monitor: MFUMonitor):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    trainer = _OnCuda(L.Fabric(accelerator="cpu", devices=1, precision="bf16-mixed"))
    module, batch = StreamingPolicyModule(make_policy()), grpo_batch(vocab_size)
    monitor.on_train_batch_start(trainer, module, batch.plan, 0)
    for item in batch.stream():
        module.ingest(item)
    module.barrier(module.configure_optimizers())
    monitor.on_train_batch_end(trainer, module, None, BatchClosed(0), len(batch.items))
    return monitor.history[-1]


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989.4e12),  # Lightning has no peak for this name (its H200 entries are sparse figures)
        ("NVIDIA H100 80GB HBM3", 989.4e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10G", 125e12),  # not in our table: Lightning's
    ],
)
def test_a_known_gpu_gets_its_dense_bf16_peak(monkeypatch, make_policy, vocab_size, name, peak):
    measurement = _update_on(monkeypatch, name, make_policy, vocab_size, MFUMonitor())
    assert measurement.mfu == pytest.approx(measurement.learner_flops / (measurement.step_s * peak))


def test_an_unknown_gpu_logs_no_mfu_and_warns_once(monkeypatch, make_policy, vocab_size):
    monitor = MFUMonitor()
    with pytest.warns(UserWarning, match=r"no peak FLOP/s known for 'NVIDIA Z9000' in torch.bfloat16") as seen:
        first = _update_on(monkeypatch, "NVIDIA Z9000", make_policy, vocab_size, monitor)
        second = _update_on(monkeypatch, "NVIDIA Z9000", make_policy, vocab_size, monitor)
    assert first.mfu is None and second.mfu is None and first.step_s > 0 and first.learner_flops > 0
    assert len([w for w in seen if "peak FLOP/s" in str(w.message)]) == 1
    overridden = _update_on(monkeypatch, "NVIDIA Z9000", make_policy, vocab_size, MFUMonitor(available_flops=PEAK))
    assert overridden.mfu == pytest.approx(overridden.learner_flops / (overridden.step_s * PEAK))


def test_the_peak_table():
    assert dense_peak_flops("NVIDIA GH200 480GB", torch.bfloat16) == 989.4e12  # not the H200 row's match by chance
    assert dense_peak_flops("NVIDIA H200 NVL", torch.bfloat16) == 835.5e12
    assert dense_peak_flops("NVIDIA H100 PCIe", torch.float16) == 756e12
    assert dense_peak_flops("AMD Instinct MI300X", torch.bfloat16) == 1307.4e12
    assert dense_peak_flops("NVIDIA B200", torch.float32) is None  # no such figure: absent, not a guess
    assert dense_peak_flops("NVIDIA GeForce RTX 4090", torch.bfloat16) is None  # left to Lightning's table
    assert dense_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == 66.9e12
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")  # float32 matrix work on the tensor cores: TF32
        assert dense_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == 494.7e12
    finally:
        torch.set_float32_matmul_precision(previous)


def test_constructor_reports_every_problem():
    with pytest.raises(ValueError, match="available_flops.*window.*warmup_updates"):
        MFUMonitor(available_flops=0.0, window=0, warmup_updates=-1)


def test_warmup_window_and_state_dict(make_policy, vocab_size, monkeypatch):
    """Means leave out warm-up updates (App. B.2) over the kept window; the history survives a checkpoint."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    monitor = MFUMonitor(available_flops=PEAK, window=3, warmup_updates=2)
    module = SimpleNamespace(policy=make_policy(torch.float32), service_log=[], update_timings={})
    clock = [0.0]
    for version, step_s in enumerate([10.0, 20.0, 30.0, 40.0]):
        plan = grpo_batch(vocab_size, version).plan
        _at(monkeypatch, clock[0], monitor.on_train_batch_start, fabric, module, plan, 0)
        clock[0] += step_s
        _at(monkeypatch, clock[0], monitor.on_train_batch_end, fabric, module, None, BatchClosed(version), 1)
    assert [m.index for m in monitor.history] == [1, 2, 3]  # window=3 keeps the last three
    assert [m.policy_version for m in monitor.history] == [1, 2, 3]
    assert monitor.mean_step_time() == 35.0 and monitor.mean_step_time(after_warmup=False) == 30.0
    assert monitor.mean_mfu() == 0.0  # no sources served: no learner FLOPs

    restored = MFUMonitor(available_flops=PEAK, window=3, warmup_updates=2)
    restored.load_state_dict(monitor.state_dict())
    assert list(restored.history) == list(monitor.history) and restored.mean_step_time() == 35.0
    assert restored.state_dict() == monitor.state_dict()
    with pytest.raises(ValueError, match="after warm-up"):
        MFUMonitor(warmup_updates=1).mean_step_time()


def test_two_ranks_sum_learner_flops_over_every_learner_device(make_policy, vocab_size, monkeypatch):
    """Eq. 10 over D learner devices: F_k sums each rank's sources; the capacity is step × D × peak."""
    reduced = []

    def all_reduce(tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        reduced.append(reduce_op)
        return tensor * 2  # the other rank served the same work

    owner = SimpleNamespace(
        world_size=2,
        global_rank=1,
        loggers=[MemoryLogger()],
        strategy=SimpleNamespace(root_device=torch.device("cpu"), all_reduce=all_reduce),
    )
    monitor, module, batch = MFUMonitor(PEAK), StreamingPolicyModule(make_policy()), grpo_batch(vocab_size)
    _at(monkeypatch, 0.0, monitor.on_train_batch_start, owner, module, batch.plan, 0)
    for item in batch.stream():
        module.ingest(item)
    module.barrier(module.configure_optimizers())
    _at(monkeypatch, 4.0, monitor.on_train_batch_end, owner, module, None, BatchClosed(0), 1)
    (m,) = monitor.history
    flops = 2 * expected_flops(module, batch)
    assert reduced == ["sum"] and m.learner_flops == flops and m.num_tokens == 2 * batch_tokens(batch)
    assert m.mfu == flops / (4.0 * PEAK * 2) and m.throughput == 2 * batch_tokens(batch) / (4.0 * 2)
    assert owner.loggers[0].logged == []  # only global rank 0 logs


def test_mfu_above_one_warns_once_that_the_declared_peak_is_too_low(make_policy, vocab_size, monkeypatch):
    fabric = L.Fabric(accelerator="cpu", devices=1)
    monitor, module = MFUMonitor(available_flops=1.0), StreamingPolicyModule(make_policy())
    optimizer = module.configure_optimizers()
    for update, now in enumerate((100.0, 200.0)):
        batch = grpo_batch(vocab_size, update)
        _at(monkeypatch, now, monitor.on_train_batch_start, fabric, module, batch.plan, 0)
        for item in batch.stream():
            module.ingest(item)
        module.barrier(optimizer)
        if update == 0:
            with pytest.warns(UserWarning, match=r"MFU .* > 1: .* set available_flops to the device's real peak"):
                _at(monkeypatch, now + 2.0, monitor.on_train_batch_end, fabric, module, None, BatchClosed(0), 1)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # said once per run, not every update
                _at(monkeypatch, now + 2.0, monitor.on_train_batch_end, fabric, module, None, BatchClosed(1), 1)
    assert all(m.mfu > 1 for m in monitor.history) and len(monitor.history) == 2
