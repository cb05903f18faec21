"""The examples run, with every callback acting: checkpoints written and resumed (the Trainer through ``ckpt_path``),
publications counted with their versions, metrics in ``callback_metrics``, one CSV row per update."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest
import torch

from tslightning.callbacks import (
    BatchBarrier,
    GPUClockCheckpoint,
    GradientClipping,
    MFUMonitor,
    ReleaseTraceRecorder,
    StalenessMonitor,
    WeightPublisher,
    read_trace,
)
from tslightning.callbacks.checkpoint_state import checkpoint_dirs, checkpoint_files, read_meta
from tslightning.callbacks.gpu_clock_checkpoint import TRAINER_META_KEY

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SOURCES_PER_UPDATE = 2 * 4  # the examples' defaults: 2 prompts × 4 completions


def example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def csv_steps(out: Path, version: int) -> list[int]:
    rows = list(csv.DictReader((out / "csv" / f"version_{version}" / "metrics.csv").open()))
    return [int(row["step"]) for row in rows]


def by_type(callbacks, kind):
    (found,) = [cb for cb in callbacks if type(cb) is kind]
    return found


def check_every_callback_acted(callbacks, updates: int) -> None:
    assert by_type(callbacks, BatchBarrier).barriers_passed == updates
    assert by_type(callbacks, GradientClipping).updates == updates
    assert by_type(callbacks, StalenessMonitor).histogram == {0: updates * SOURCES_PER_UPDATE}
    monitor = by_type(callbacks, MFUMonitor)
    assert len(monitor.history) == updates and all(m.mfu > 0 and m.publication_s > 0 for m in monitor.history)


def test_plain_trainer_grpo_module(tmp_path):
    grpo_trainer = example("grpo_trainer")
    out = tmp_path / "trainer"
    trainer = grpo_trainer.main(["--out", str(out), "--updates", "3"])
    callbacks = trainer.callbacks
    check_every_callback_acted(callbacks, 3)
    publisher = by_type(callbacks, WeightPublisher)
    assert publisher.engine.publications == [1, 2, 3] and publisher.publications == 3
    metrics = trainer.callback_metrics
    for name in ("actor/grad_norm", "actor/grad_clip_coef", "timing_s/update_weights", "perf/mfu/actor"):
        assert name in metrics, name
    assert metrics["staleness/max_policy_lag"] == 0 and 0 <= metrics["train/reward"] <= 1
    assert float(metrics["actor/grad_norm"]) == by_type(callbacks, GradientClipping).last_grad_norm
    assert csv_steps(out, 0) == [0, 1, 2]  # one row per update, the module's self.log and every callback's metrics
    written = checkpoint_files(out / "checkpoints")
    assert [path.rsplit("/", 1)[-1] for path in written] == ["update-0.ckpt", "update-1.ckpt", "update-2.ckpt"]
    uninterrupted = torch.load(written[2], weights_only=False)
    assert uninterrupted[TRAINER_META_KEY]["trajectories_seen"] == 3 * SOURCES_PER_UPDATE
    assert trainer.checkpoint_callback.best_model_path  # Lightning's ModelCheckpoint, monitoring actor/grad_norm

    resumed = grpo_trainer.main(["--out", str(out), "--updates", "4", "--resume", written[1]])
    assert resumed.global_step == 4
    publisher = by_type(resumed.callbacks, WeightPublisher)
    assert publisher.engine.publications == [2, 3, 4]  # the restored θ_2 first, then θ_3 and θ_4
    assert publisher.publications == 4 and by_type(resumed.callbacks, GPUClockCheckpoint).checkpoints_written == 4
    assert csv_steps(out, 1) == [2, 3]
    again = torch.load(written[2], weights_only=False)  # update 2, redone by the resumed run
    assert again[TRAINER_META_KEY]["trajectories_seen"] == 3 * SOURCES_PER_UPDATE
    for name, tensor in uninterrupted["state_dict"].items():
        torch.testing.assert_close(again["state_dict"][name], tensor, rtol=0, atol=1e-6)
    trace = read_trace(out / "trace")
    assert [r["update"] for r in trace if r["record"] == "update"] == [0, 1, 2, 3]
    assert sum(r["record"] == "source" for r in trace) == 4 * SOURCES_PER_UPDATE


def test_fabric_loop_with_the_streaming_module(tmp_path):
    streaming_fabric = example("streaming_fabric")
    out = tmp_path / "fabric"
    run = streaming_fabric.main(["--out", str(out), "--updates", "3"])
    check_every_callback_acted(run["callbacks"], 3)
    assert run["engine"].publications == [1, 2, 3] and run["module"].policy_version == 3
    assert csv_steps(out, 0) == [0, 1, 2]
    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    assert all(row["train/reward"] and row["actor/grad_norm"] and row["perf/mfu/actor"] for row in rows)
    assert [p.name for p in checkpoint_dirs(out / "checkpoints")] == ["update-0", "update-1", "update-2"]
    assert read_meta(out / "checkpoints" / "update-2")["trajectories_seen"] == 3 * SOURCES_PER_UPDATE
    uninterrupted = torch.load(out / "checkpoints" / "update-2" / "state.pt", weights_only=True)["state_dict"]

    run = streaming_fabric.main(
        ["--out", str(out), "--updates", "4", "--resume", str(out / "checkpoints" / "update-1")]
    )
    assert run["engine"].publications == [2, 3, 4] and run["module"].policy_version == 4
    assert by_type(run["callbacks"], WeightPublisher).publications == 4
    assert csv_steps(out, 1) == [2, 3]
    again = torch.load(out / "checkpoints" / "update-2" / "state.pt", weights_only=True)["state_dict"]
    for name, tensor in uninterrupted.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=1e-6)
    assert [r["update"] for r in read_trace(out / "trace") if r["record"] == "update"] == [0, 1, 2, 3]
    assert by_type(run["callbacks"], ReleaseTraceRecorder).next_update == 4
