"""Acceptance: kill a run during update k, resume from the last checkpoint, finish — the final parameters equal an
uninterrupted run's and nothing is double-counted (trajectories, scored tokens, publications, the release trace)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import torch
import yaml

from tslightning import cli
from tslightning.callbacks import read_trace
from tslightning.callbacks.checkpoint_state import read_meta
from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import TrajectorySource
from tslightning.distributed.learner_strategy import LearnerSettings
from tslightning.learner.streaming_module import OptimizerSettings
from tslightning.loop.fit import AlgorithmSettings, CheckpointSettings, RolloutSettings, WarmStartSettings, fit
from tslightning.loop.settings import InvalidSettingsError

fit_module = importlib.import_module("tslightning.loop.fit")  # the module; the package's `fit` is the function

KILLED_AT = 2
EVERY_UPDATE = CheckpointSettings(interval_s=1e-9)  # any positive GPU-clock is past the interval


class Killed(RuntimeError):
    """Stands in for the process dying (OOM, preemption) in the middle of an update."""


def run(out: Path, **overrides):
    """The quickstart's settings, shrunk: 3 updates of 2 prompts × 2 samples after a 100-step warm start."""
    rollout = RolloutSettings(
        prompts_per_update=2, samples_per_prompt=2, max_turns=3, max_tokens_per_turn=96, max_tokens_per_trajectory=256
    )
    settings = dict(
        updates=3,
        seed=42,
        out_dir=str(out),
        rollout=rollout,
        warm_start=WarmStartSettings(steps=100),
        algorithm=AlgorithmSettings(optimizer=OptimizerSettings(lr=3e-4)),
        available_flops=1e11,
        progress=False,
    )
    return fit(**(settings | overrides))


def killed_during(update: int, original):
    """``one_update`` that, at ``update``, ingests the plan and two ready sources and then dies."""

    def one_update(fabric, module, optimizer, stream, index: int) -> None:
        if index != update:
            return original(fabric, module, optimizer, stream, index)
        ingested = 0
        for item in stream:
            module.ingest(item)
            if isinstance(item, BatchPlan):
                fabric.call("on_train_batch_start", trainer=fabric, pl_module=module, batch=item, batch_idx=index)
            ingested += isinstance(item, TrajectorySource)
            if ingested == 2:
                raise Killed(f"killed during update {index} after {ingested} sources")

    return one_update


def final_state(out: Path, update: int) -> tuple[dict, dict]:
    directory = out / "checkpoints" / f"update-{update}"
    return torch.load(directory / "state.pt", weights_only=True), read_meta(directory)


def test_kill_resume_finish_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    uninterrupted = tmp_path / "uninterrupted"
    run(uninterrupted)
    state_a, meta_a = final_state(uninterrupted, 2)

    interrupted = tmp_path / "interrupted"
    with monkeypatch.context() as patch:
        patch.setattr(fit_module, "one_update", killed_during(KILLED_AT, fit_module.one_update))
        with pytest.raises(Killed):
            run(interrupted, checkpoint=EVERY_UPDATE)
    checkpoints = interrupted / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["update-0", "update-1"]  # nothing of update 2
    resumed = run(interrupted, checkpoint=EVERY_UPDATE, resume=str(checkpoints / f"update-{KILLED_AT - 1}"))
    state_b, meta_b = final_state(interrupted, 2)

    assert len(resumed.mean_rewards) == 1  # only update 2 ran after the resume
    # The resume recorded its own config beside the run's, which it left as it was.
    assert yaml.safe_load((interrupted / "config.yaml").read_text())["resume"] is None
    assert yaml.safe_load((interrupted / "config.resume-1.yaml").read_text())["resume"].endswith("update-1")
    assert (interrupted / "rewards.resume-1.json").is_file()
    theta_a, theta_b = state_a["state_dict"], state_b["state_dict"]
    assert theta_a.keys() == theta_b.keys()
    gap = max((theta_a[name] - theta_b[name]).abs().max().item() for name in theta_a)
    assert gap <= 1e-6, f"max |θ_A − θ_B| = {gap}"
    print(f"\nmax |θ_A − θ_B| = {gap}; bit-identical: {all(torch.equal(theta_a[n], theta_b[n]) for n in theta_a)}")

    for field in ("trajectories_seen", "scored_tokens_seen", "policy_version", "update", "seed"):
        assert meta_b[field] == meta_a[field], field
    assert meta_a["trajectories_seen"] == 3 * 2 * 2 and meta_a["policy_version"] == 3
    for key, callback_state in state_a["callbacks"].items():
        if key.startswith(("WeightPublisher", "StalenessMonitor")):
            assert state_b["callbacks"][key] == callback_state, key  # 3 publications, 3 updates' lags
    updates = [r["update"] for r in read_trace(interrupted / "trace") if r["record"] == "update"]
    assert updates == [0, 1, 2]


@pytest.mark.parametrize("schedule", ["async", "fully_async"])
def test_schedules_that_sample_ahead_refuse_to_resume_before_any_work(tmp_path, schedule):
    with pytest.raises(ValueError, match=f"schedule '{schedule}' cannot resume exactly"):
        fit(schedule=schedule, out_dir=str(tmp_path / "run"), resume=str(tmp_path), progress=False)
    assert not (tmp_path / "run").exists()


def test_resume_from_a_directory_that_is_no_checkpoint_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no state.pt; give an update-<k> checkpoint directory"):
        fit(out_dir=str(tmp_path / "run"), resume=str(tmp_path), progress=False)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "meta"])
def test_a_corrupt_checkpoint_is_named_in_one_line_before_any_work(tmp_path, damage, capsys):
    checkpoint = tmp_path / "checkpoints" / "update-1"
    checkpoint.mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.ones(1000)}}, checkpoint / "state.pt")
    (checkpoint / "meta.json").write_text('{"policy_hash": "sha256:0"}')
    state = (checkpoint / "state.pt").read_bytes()
    if damage == "truncated":
        (checkpoint / "state.pt").write_bytes(state[: len(state) // 2])
    elif damage == "garbage":
        (checkpoint / "state.pt").write_bytes(b"\x80\x04not a checkpoint at all")
    else:
        (checkpoint / "meta.json").write_text('{"policy_hash": ')
    broken = checkpoint / ("meta.json" if damage == "meta" else "state.pt")
    with pytest.raises(InvalidSettingsError, match=f"resume: (cannot read )?{broken}") as info:
        fit(out_dir=str(tmp_path / "run"), resume=str(checkpoint), progress=False)
    assert "\n" not in str(info.value) and "update-<k>" in str(info.value)
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--out_dir", str(tmp_path / "run"), "--resume", str(checkpoint)])
    (line,) = capsys.readouterr().err.strip().splitlines()  # one line, naming the file; no traceback
    assert exit_info.value.code == 2 and str(broken) in line and "Traceback" not in line


def _sharded_checkpoint(root: Path, layout: str = "deepspeed_stage_2", world_size: int = 2) -> Path:
    """An ``update-3`` directory as 2 DeepSpeed ranks leave it (the engine's checkpoint in ``state.pt/``)."""
    checkpoint = root / "checkpoints" / "update-3"
    (checkpoint / "state.pt" / "checkpoint").mkdir(parents=True)
    (checkpoint / "state.pt" / "latest").write_text("checkpoint")
    for rank in range(world_size):
        (checkpoint / "state.pt" / "checkpoint" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"s")
    meta = {"policy_hash": "sha256:0", "layout": layout, "world_size": world_size, "strategy": "DeepSpeedStrategy"}
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    return checkpoint


@pytest.mark.parametrize(
    ("strategy", "devices", "named"),
    [("deepspeed_stage_2", 1, "on 1 rank(s) (learner.devices × learner.num_nodes): its 'deepspeed_stage_2' shards are "
      "for 2 ranks"),
     ("ddp", 2, "learner.strategy 'ddp' on 2 rank(s)")],
)  # fmt: skip
def test_a_sharded_checkpoint_on_another_process_count_or_strategy_is_refused_before_any_work(
    tmp_path, strategy, devices, named
):
    checkpoint = _sharded_checkpoint(tmp_path)
    learner = LearnerSettings(devices=devices, strategy=strategy)
    with pytest.raises(InvalidSettingsError) as info:
        fit(out_dir=str(tmp_path / "run"), resume=str(checkpoint), learner=learner, progress=False)
    (problem,) = info.value.problems
    assert problem.startswith(f"resume: {checkpoint} cannot continue as") and named in problem
    assert "resume with learner.strategy deepspeed_stage_2 on 2 rank(s)" in problem and "\n" not in problem
    assert not (tmp_path / "run").exists()


def test_a_sharded_checkpoint_missing_its_index_is_named_before_any_work(tmp_path):
    checkpoint = _sharded_checkpoint(tmp_path)
    (checkpoint / "state.pt" / "latest").unlink()
    learner = LearnerSettings(devices=2, strategy="deepspeed_stage_2")
    with pytest.raises(InvalidSettingsError, match=rf"resume: {checkpoint / 'state.pt'} lacks latest of its deepspeed"):
        fit(out_dir=str(tmp_path / "run"), resume=str(checkpoint), learner=learner, progress=False)
    assert not (tmp_path / "run").exists()
