"""fit --replay_batches: a recorded run replayed through fit's own learner, and the recordings it refuses.

The replays run in float64 (``--model.precision 64-true``) from the recorded run's ``policy-0``: the recorded run and
the replay fold the same items in the same order on the same ranks, so their parameters are bitwise equal.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tslightning import cli
from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import BatchClosed, GroupClosed, TrajectorySource, TurnSource
from tslightning.loop.batch_recording import batch_file
from tslightning.loop.batch_replay import RecordedBatches
from tslightning.models.tiny_model import load_tiny_model

ROOT = Path(__file__).parents[2]
UPDATES = 2
SMALL = [
    "--config=quickstart",
    f"--updates={UPDATES}",
    "--progress=false",
    "--model.precision=64-true",
    "--algorithm.optimizer.lr=1e-3",
    "--rollout.environment=simulated_tool",  # observations and rewards a pure function of (seed, task, attempt)
    "--rollout.task_names=null",
    "--rollout.simulated_tool.num_tasks=4",
    "--rollout.simulated_tool.median_latency_s=0.01",
    "--rollout.simulated_tool.max_latency_s=0.05",
    "--rollout.prompts_per_update=2",
    "--rollout.samples_per_prompt=3",
    "--rollout.max_turns=2",
    "--rollout.max_tokens_per_turn=48",
]
"""A short thundersync GRPO run of the quickstart, float64."""


def _replay_options(recorded: Path) -> list[str]:
    """Replay ``recorded``'s batches from its θ_0 (its ``policy-0``, no warm start of its own)."""
    return [f"--replay_batches={recorded / 'batches'}", f"--model.path={recorded / 'policy-0'}", "--warm_start.steps=0"]


def _final_theta(out: Path) -> dict[str, torch.Tensor]:
    state = torch.load(out / "checkpoints" / f"update-{UPDATES - 1}" / "state.pt", weights_only=True)["state_dict"]
    return {name: tensor for name, tensor in state.items() if name.startswith("policy.")}


def _assert_bitwise_equal_and_moved(replayed: Path, recorded: Path) -> None:
    theta, reference = _final_theta(replayed), _final_theta(recorded)
    assert theta.keys() == reference.keys() and theta
    differing = [name for name in reference if not torch.equal(theta[name], reference[name])]
    assert not differing, f"{len(differing)} tensor(s) differ from the recorded run's, e.g. {differing[:3]}"
    assert all(t.dtype == torch.float64 for t in theta.values())
    initial, _ = load_tiny_model(recorded / "policy-0")
    theta0 = {f"policy.{name}": tensor.double() for name, tensor in initial.state_dict().items()}  # float32 saved
    moved = [name for name, tensor in theta0.items() if not torch.equal(theta[name], tensor)]
    assert moved  # the updates moved θ: the comparison is not vacuous


def _publication_seconds(out: Path) -> list[float]:
    rows = csv.DictReader(next((out / "csv").rglob("metrics.csv")).open())
    return [float(row["timing_s/update_weights"]) for row in rows if row["timing_s/update_weights"]]


def test_a_replay_on_one_rank_ends_bitwise_at_the_recorded_runs_parameters(tmp_path, caplog):
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    cli.main(["fit", *SMALL, "--warm_start.steps=150", "--record_batches=true", f"--out_dir={recorded}", "--debug"])
    with caplog.at_level("INFO"):
        cli.main(["fit", *SMALL, *_replay_options(recorded), f"--out_dir={replayed}", "--debug"])

    _assert_bitwise_equal_and_moved(replayed, recorded)
    assert "no rollout engine is started, nothing is published" in caplog.text
    assert len(_publication_seconds(recorded)) == UPDATES and all(s > 0 for s in _publication_seconds(recorded))
    assert _publication_seconds(replayed) == [0.0] * UPDATES  # no publisher: nothing published
    assert not (replayed / "batches").exists()
    rewards = [json.loads((out / "rewards.json").read_text())["mean_rewards"] for out in (recorded, replayed)]
    assert rewards[1] == pytest.approx(rewards[0], abs=1e-12)  # from the recorded sources
    config = (replayed / "config.yaml").read_text()
    assert f"replay_batches: {recorded / 'batches'}" in config  # re-runnable with --config


def _fit_two_ranks(out: Path, *options: str) -> None:
    command = [sys.executable, "-m", "tslightning.cli", "fit", *SMALL, "--learner.devices=2"]
    command += ["--learner.strategy=ddp", f"--out_dir={out}", *options]
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_a_replay_on_two_ddp_ranks_ends_bitwise_at_the_recorded_runs_parameters(tmp_path):
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"
    _fit_two_ranks(recorded, "--warm_start.steps=150", "--record_batches=true")
    assert sorted(p.name for p in (recorded / "batches").iterdir()) == [
        f"rank{r}-update{k}.pt" for r in (0, 1) for k in range(UPDATES)
    ]
    _fit_two_ranks(replayed, *_replay_options(recorded))
    _assert_bitwise_equal_and_moved(replayed, recorded)


# ----------------------------------------------------------------- refusals, before anything is written
def _trajectory(group: str, index: int, version: int, reward: float = 1.0) -> TrajectorySource:
    ids = torch.tensor([3, 4, 5, 6])
    return TrajectorySource(group, index, ids, torch.tensor([False, False, True, True]), reward, version, 2)


def _record(directory: Path, rank: int, update: int, version: int | None = None, **plan) -> None:
    version = update if version is None else version
    items = [
        BatchPlan(Objective.GRPO, version, {"g": 2}, **plan),
        _trajectory("g", 0, version, 1.0),
        _trajectory("g", 1, version, 0.0),
        GroupClosed("g"),
        BatchClosed(version),
    ]
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(items, batch_file(directory, rank, update))


def _refused(tmp_path: Path, recording: Path, *options: str) -> str:
    out = tmp_path / "out"
    with pytest.raises((ValueError, FileNotFoundError)) as refused:
        cli.main(["fit", *SMALL, f"--replay_batches={recording}", f"--out_dir={out}", "--debug", *options])
    assert not out.exists()  # nothing was written
    return str(refused.value)


def test_a_missing_rank_file_is_refused(tmp_path):
    recording = tmp_path / "batches"
    _record(recording, 0, 0)
    message = _refused(tmp_path, recording)
    assert f"replay_batches {recording} lacks rank0-update1.pt of the 2 update(s) this run replays" in message
    assert "set updates to at most 1" in message and "\n" not in message


def test_another_world_size_is_refused(tmp_path):
    recording = tmp_path / "batches"
    for rank in (0, 1):
        for update in range(UPDATES):
            _record(recording, rank, update)
    message = _refused(tmp_path, recording)
    assert "was recorded on 2 learner rank(s) and this run has 1" in message and "set them to 2 ranks" in message


def test_items_of_another_policy_version_are_refused(tmp_path):
    recording = tmp_path / "batches"
    _record(recording, 0, 0)
    _record(recording, 0, 1, version=0)  # update 1's file holds items sampled at θ_0
    message = _refused(tmp_path, recording)
    assert f"{batch_file(recording, 0, 1)} holds items of policy version(s) [0]" in message
    assert "the replay reaches update 1 at θ_1" in message


def test_a_fully_async_recording_is_refused(tmp_path):
    recording = tmp_path / "batches"
    _record(recording, 0, 0)
    _record(recording, 0, 1, oldest_policy_version=0)
    assert "was recorded under schedule fully_async" in _refused(tmp_path, recording)


def test_another_objective_is_refused(tmp_path):
    recording = tmp_path / "batches"
    for update in range(UPDATES):
        _record(recording, 0, update)
    message = _refused(tmp_path, recording, "--objective=opd")
    assert "was recorded with objective grpo: set objective to it" in message


def test_a_half_written_file_is_refused(tmp_path):
    recording = tmp_path / "batches"
    _record(recording, 0, 0)
    batch_file(recording, 0, 1).write_bytes(batch_file(recording, 0, 0).read_bytes()[:100])  # killed mid-write
    assert f"{batch_file(recording, 0, 1)} cannot be read" in _refused(tmp_path, recording)


class _Planted:
    """An object a recorded file must not build (unpickling it would run this module's code)."""

    def __reduce__(self):
        return (print, ("unpickled",))


def test_a_file_holding_anything_but_stream_items_is_refused_unread(tmp_path, capsys):
    recording = tmp_path / "batches"
    _record(recording, 0, 0)
    torch.save([BatchPlan(Objective.GRPO, 1, {"g": 2}), _Planted()], batch_file(recording, 0, 1))
    message = _refused(tmp_path, recording)
    assert f"{batch_file(recording, 0, 1)} cannot be read (UnpicklingError" in message
    assert "unpickled" not in capsys.readouterr().out  # the weights-only unpickler built nothing it does not allow


@pytest.mark.parametrize("schedule", ["async", "fully_async"])
def test_a_continuous_schedule_is_refused(tmp_path, schedule):
    recording = tmp_path / "batches"
    for update in range(UPDATES):
        _record(recording, 0, update)
    message = _refused(tmp_path, recording, f"--schedule={schedule}")
    assert f"schedule {schedule} samples continuously or one step off" in message


def test_recording_into_the_replayed_directory_is_refused(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ValueError) as refused:
        replay = f"--replay_batches={out / 'batches'}"
        cli.main(["fit", *SMALL, replay, "--record_batches=true", f"--out_dir={out}", "--debug"])
    assert "is where record_batches would write this run's batches" in str(refused.value)
    assert not out.exists()


def test_a_missing_directory_is_a_missing_path(tmp_path):
    message = _refused(tmp_path, tmp_path / "nowhere")
    assert f"replay_batches {tmp_path / 'nowhere'} is not a directory" in message


# ----------------------------------------------------------------- the recorded rollout metrics
def test_recorded_rewards_are_the_grpo_outcome_and_an_opd_recording_has_none(tmp_path):
    _record(tmp_path, 0, 0)
    batches = RecordedBatches(tmp_path, rank=0)
    items = list(batches.stream_update(0))
    assert isinstance(items[0], BatchPlan) and isinstance(items[-1], BatchClosed) and len(items) == 5
    outcome = batches.outcome(0)
    assert outcome.rewards == [1.0, 0.0] and outcome.rewards_known and not outcome.metrics

    turn = TurnSource("g", 0, 0, torch.tensor([3, 4, 5]), torch.tensor([False, True, True]), torch.zeros(2), 0)
    torch.save([BatchPlan(Objective.OPD, 0, {"g": 1}), turn, BatchClosed(0)], batch_file(tmp_path, 0, 1))
    list(batches.stream_update(1))
    opd = batches.outcome(1)
    assert opd.rewards == [] and not opd.rewards_known and opd.teacher_tokens == 0
