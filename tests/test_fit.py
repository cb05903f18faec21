"""The README's main job, `tslightning fit --config configs/quickstart.yaml`, in a shortened form."""

from __future__ import annotations

import json

from tslightning import cli


def test_quickstart_fit_runs_end_to_end(tmp_path):
    out = tmp_path / "run"
    cli.main(
        [
            "fit",
            "--config",
            "configs/quickstart.yaml",
            "--updates",
            "2",
            "--warm_start.steps",
            "150",
            "--rollout.prompts_per_update",
            "2",
            "--out_dir",
            str(out),
            "--progress",
            "false",
        ]
    )
    rewards = json.loads((out / "rewards.json").read_text())
    assert len(rewards["mean_rewards"]) == 2 and all(0.0 <= r <= 1.5 for r in rewards["mean_rewards"])
    config = json.loads((out / "config.json").read_text())
    assert config["schedule"] == "thundersync" and config["rollout"]["prompts_per_update"] == 2
    metrics = list((out / "csv").rglob("metrics.csv"))
    assert metrics and "train/mean_reward" in metrics[0].read_text()
    assert list((out / "tensorboard").rglob("events.out.tfevents.*"))
    trace = list((out / "trace").rglob("*.jsonl"))
    assert trace and trace[0].read_text().strip()
