"""The README's main job, `tslightning fit --config configs/quickstart.yaml`, in a shortened form."""

from __future__ import annotations

import json

import yaml
from wandb_offline import history

from tslightning import cli


def test_quickstart_fit_runs_end_to_end(tmp_path, capsys, monkeypatch):
    """The quickstart, shortened, with a W&B logger beside CSV and TensorBoard (offline: nothing leaves the machine);
    it ends with the summary: reward, step times, where everything went and the next commands."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    loggers = "[{class_path: CSVLogger, init_args: {name: csv}}, {class_path: TensorBoardLogger}, "
    loggers += "{class_path: WandbLogger, init_args: {offline: true, project: quickstart}}]"
    small = ["--updates", "2", "--warm_start.steps", "150", "--rollout.prompts_per_update", "2"]
    cli.main(["fit", "--config", "configs/quickstart.yaml", *small, "--out_dir", str(out), "--progress", "false"]
             + ["--loggers", loggers])  # fmt: skip
    rewards = json.loads((out / "rewards.json").read_text())
    assert len(rewards["mean_rewards"]) == 2 and all(0.0 <= r <= 1.5 for r in rewards["mean_rewards"])
    assert len(rewards["direction_norms"]) == 2
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["schedule"] == "thundersync" and config["rollout"]["prompts_per_update"] == 2
    assert config["loggers"][2] == {
        "class_path": "WandbLogger",
        "init_args": {"offline": True, "project": "quickstart"},
    }
    metrics = list((out / "csv").rglob("metrics.csv"))
    assert metrics and "train/mean_reward" in metrics[0].read_text()
    assert list((out / "lightning_logs").rglob("events.out.tfevents.*"))  # TensorBoard's default name, in out_dir
    trace = list((out / "trace").rglob("*.jsonl"))
    assert trace and trace[0].read_text().strip()
    _finish_wandb()
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    assert history(run_file, "train/mean_reward") == list(enumerate(rewards["mean_rewards"]))
    printed = capsys.readouterr().out
    first = f"{rewards['mean_rewards'][0]:.3f} (first 1) → {rewards['mean_rewards'][1]:.3f} (last 1)"
    assert "tslightning fit: grpo (thundersync), updates 0-1" in printed and first in printed
    assert "step time" in printed and f"{out}/checkpoints/ (latest update-1)" in printed
    assert f"W&B (offline)   {out / 'wandb'}" in printed and str(metrics[0]) in printed
    assert (
        f"tslightning validate --checkpoint {out}" in printed and f"tslightning replay --trace {out}/trace" in printed
    )
    assert f"--resume {out}/checkpoints/update-1 --updates 12" in printed


def _finish_wandb() -> None:
    """Close the W&B run (Lightning leaves that to the process's exit), so its files are complete."""
    import wandb

    wandb.finish()


def _lags(out):
    import csv

    rows = list(csv.DictReader(next((out / "csv").rglob("metrics.csv")).open()))
    return [float(r["staleness/max_policy_lag"]) for r in rows if r.get("staleness/max_policy_lag")]


def _short_fit(out, schedule, *extra):
    cli.main(
        [
            "fit",
            "--config",
            "configs/quickstart.yaml",
            "--updates",
            "3",
            "--warm_start.steps",
            "150",
            "--rollout.prompts_per_update",
            "2",
            "--rollout.samples_per_prompt",
            "2",
            "--out_dir",
            str(out),
            "--progress",
            "false",
            "--schedule",
            schedule,
            "--debug",  # a bad setting raises its error instead of exiting
            *extra,
        ]
    )
    return json.loads((out / "rewards.json").read_text())


def test_async_is_one_step_off(tmp_path):
    """Batch 0 comes from θ_0 (lag 0); every later batch was sampled one version behind the learner."""
    rewards = _short_fit(tmp_path / "async", "async")
    assert len(rewards["mean_rewards"]) == 3
    assert _lags(tmp_path / "async") == [0.0, 1.0, 1.0]


def test_fully_async_rolls_out_across_updates_with_a_bounded_lag(tmp_path):
    """Rollout never stops: while update 0 learns, the next groups are already sampled from θ_0, so update 1 trains
    on them one version behind (lag 1); the bound keeps every lag ≤ 1; batches are the first P groups to complete."""
    rewards = _short_fit(tmp_path / "fa", "fully_async", "--staleness_bound", "1")
    lags = _lags(tmp_path / "fa")
    assert len(rewards["mean_rewards"]) == 3 and len(lags) == 3
    assert lags[0] == 0.0 and lags[1] == 1.0 and all(lag <= 1.0 for lag in lags)
    trace = [json.loads(line) for path in (tmp_path / "fa" / "trace").rglob("*.jsonl") for line in path.open()]
    groups = {r["group"] for r in trace if r["record"] == "source"}
    assert groups and all(g.startswith("g") for g in groups)  # continuous slots, not per-update prompts


def test_sync_and_thundersync_fits_reach_the_same_parameters_float64(tmp_path):
    """Same seed, same rollouts (seeds by identity, not arrival): the two zero-staleness schedules end at the same θ,
    with the recompute and with the boundary-adjoint (App. I) streamed learner."""
    import torch

    from tslightning.loop.fit import RolloutSettings, WarmStartSettings, fit
    from tslightning.models.tiny_model import load_tiny_model
    from tslightning.tasks.simulated_tool import SimulatedToolSettings

    thetas = {}
    for name, schedule, context in (
        ("sync", "sync", "recompute"),
        ("thundersync", "thundersync", "recompute"),
        ("boundary", "thundersync", "boundary"),
    ):
        out = tmp_path / name
        fit(
            schedule=schedule,
            updates=3,
            seed=5,
            out_dir=str(out),
            progress=False,
            available_flops=1e11,
            # The simulated tool's observations and rewards are a pure function of (seed, task, attempt, call): a
            # terminal command's output can depend on timing (one cut by its time or output limit ends differently
            # under different CPU load), which would change the rollouts, not the learner, between the schedules.
            rollout=RolloutSettings(
                environment="simulated_tool",
                simulated_tool=SimulatedToolSettings(num_tasks=4, median_latency_s=0.01, max_latency_s=0.05),
                prompts_per_update=2,
                samples_per_prompt=3,
                max_turns=3,
                max_tokens_per_turn=64,
                # Every request decoded alone and prefilled afresh: the sampled tokens then cannot depend on which
                # requests happened to share a batch or a cached prefix (float rounding differs between those).
                max_batch_size=1,
                prefix_cache_tokens=0,
            ),
            warm_start=WarmStartSettings(steps=150),  # a policy still exploring: groups with unequal rewards
            model=_float64(),
            algorithm=_algorithm(1e-3, context),
        )
        state = torch.load(out / "checkpoints" / "update-2" / "state.pt", weights_only=True)["state_dict"]
        theta0, _ = load_tiny_model(out / "policy-0")
        initial = {f"policy.{k}": v for k, v in theta0.state_dict().items()}
        names = sorted(k for k in state if k in initial)
        thetas[name] = torch.cat([state[k].flatten().double() for k in names])
        thetas["initial"] = torch.cat([initial[k].flatten().double() for k in names])
    sync = thetas["sync"]
    moved = float((sync - thetas["initial"]).norm())
    assert moved > 0
    for streamed in (thetas["thundersync"], thetas["boundary"]):
        assert float((streamed - sync).norm()) / moved <= 1e-10  # Δ_k of Eq. 30


def _float64():
    from tslightning.loop.fit import ModelSettings

    return ModelSettings(precision="64-true")


def _algorithm(lr, context_backward="recompute"):
    from tslightning.learner.streaming_module import OptimizerSettings
    from tslightning.loop.fit import AlgorithmSettings

    return AlgorithmSettings(optimizer=OptimizerSettings(lr=lr), context_backward=context_backward)


def test_boundary_context_backward_needs_thundersync(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="context_backward"):
        _short_fit(tmp_path / "bad", "sync", "--algorithm.context_backward", "boundary")


def test_teacher_cpus_needs_the_opd_objective(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="model.teacher_cpus places the OPD teacher; objective 'grpo'"):
        _short_fit(tmp_path / "bad", "sync", "--model.teacher_cpus", "[0]")


def test_the_saved_config_re_runs_the_run(tmp_path):
    """config.yaml is the resolved config, extra callbacks as class_path/init_args: `tslightning fit --config
    runs/X/config.yaml --out_dir Y` runs the same settings again, and the first run's directory is not reused."""
    first, second = tmp_path / "first", tmp_path / "second"
    small = ["--updates", "1", "--warm_start.steps", "0", "--rollout.prompts_per_update", "1"]
    small += ["--rollout.samples_per_prompt", "2", "--rollout.max_turns", "1", "--rollout.max_tokens_per_turn", "16"]
    extra = "[{class_path: tslightning.callbacks.StalenessMonitor, init_args: {max_policy_lag: 3}}]"
    cli.main(
        ["fit", "--config", "quickstart", *small, "--callbacks", extra, "--progress", "false", "--out_dir", str(first)]
    )
    cli.main(["fit", "--config", str(first / "config.yaml"), "--out_dir", str(second)])
    original, rerun = (yaml.safe_load((out / "config.yaml").read_text()) for out in (first, second))
    assert rerun == original | {"out_dir": str(second)}
    assert original["updates"] == 1 and original["rollout"]["samples_per_prompt"] == 2
    assert original["callbacks"] == [
        {"class_path": "tslightning.callbacks.staleness_monitor.StalenessMonitor", "init_args": {"max_policy_lag": 3}}
    ]
    rewards = [json.loads((out / "rewards.json").read_text())["mean_rewards"] for out in (first, second)]
    assert len(rewards[0]) == 1 and rewards[0] == rewards[1]  # same seed, same rollouts


def test_environment_prefetch_changes_no_recorded_batch(tmp_path):
    """Update 1's attempts take environments prefetched during update 0's tail and barrier, and every recorded batch
    (tasks, seeds, tokens, command outputs, rewards) is the one the run without prefetch records."""
    import csv

    from tslightning.core.sources import TrajectorySource
    from tslightning.loop.batch_recording import load_batches

    def recorded_run(prefetch: int) -> tuple[list, list[float]]:
        out = tmp_path / f"prefetch-{prefetch}"
        small = ["--updates", "2", "--warm_start.steps", "150", "--rollout.prompts_per_update", "2"]
        small += ["--rollout.samples_per_prompt", "2", "--rollout.max_turns", "2", "--checkpoint.enabled", "false"]
        settings = ["--rollout.prefetch_environments", str(prefetch), "--record_batches", "true"]
        cli.main(["fit", "--config", "quickstart", *small, *settings, "--progress", "false", "--out_dir", str(out)])
        batches = []
        for update in range(2):
            (items,) = load_batches(out / "batches", update).values()
            sources = [i for i in items if isinstance(i, TrajectorySource)]
            batches.append(sorted((s.group_id, s.trajectory_index, s.token_ids.tolist(), s.reward) for s in sources))
        rows = csv.DictReader(next((out / "csv").rglob("metrics.csv")).open())
        prefetched = [float(r["rollout/prefetched_environments"]) for r in rows if r["rollout/prefetched_environments"]]
        return batches, prefetched

    with_prefetch, used = recorded_run(3)
    without_prefetch, unused = recorded_run(0)
    assert used == [0.0, 3.0] and unused == [0.0, 0.0]  # update 1's first 3 attempts took prefetched environments
    assert with_prefetch == without_prefetch
