"""A run's output directory: claimed only when no earlier run would be lost; one config and rewards file per
segment of the run; ``--overwrite`` removes only what fit wrote."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from lightning.fabric.utilities.rank_zero import rank_zero_only

from tslightning.loop.run_directory import RunDirectory, open_run_directory, run_directory_problems

CONFIG = {"objective": "grpo", "updates": 3, "resume": None}


def test_a_fresh_run_claims_an_empty_or_missing_directory_and_records_its_config(tmp_path):
    out = tmp_path / "run"
    assert run_directory_problems(str(out), None, False) == []
    run = open_run_directory(str(out), CONFIG)
    assert run == RunDirectory(out, 0) and run.config_file == out / "config.yaml"
    text = run.config_file.read_text()
    assert text.startswith("# tslightning fit: the resolved config of") and yaml.safe_load(text) == CONFIG
    assert run.rewards_file == out / "rewards.json"
    (problem,) = run_directory_problems(str(out), None, False)
    assert f"out_dir {out} already holds a run (config.yaml)" in problem and "--overwrite true" in problem


def test_files_that_are_not_a_runs_outputs_do_not_block_and_survive_overwrite(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "policy-0").mkdir()
    (tmp_path / "policy-0" / "model.safetensors").write_text("old")
    (tmp_path / "config.resume-2.yaml").write_text("old")
    assert "policy-0" in run_directory_problems(str(tmp_path), None, False)[0]
    assert run_directory_problems(str(tmp_path), None, True) == []
    open_run_directory(str(tmp_path), CONFIG, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml", "notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_each_resume_records_its_own_config_and_rewards_and_keeps_the_runs(tmp_path):
    first = open_run_directory(str(tmp_path), CONFIG)
    original = first.config_file.read_bytes()
    assert run_directory_problems(str(tmp_path), "ckpt/update-1", False) == []
    resumed = open_run_directory(str(tmp_path), {**CONFIG, "resume": "ckpt/update-1"}, resume="ckpt/update-1")
    again = open_run_directory(str(tmp_path), {**CONFIG, "resume": "ckpt/update-2"}, resume="ckpt/update-2")
    assert (resumed.segment, again.segment) == (1, 2)
    assert first.config_file.read_bytes() == original
    assert yaml.safe_load(resumed.config_file.read_text())["resume"] == "ckpt/update-1"
    assert resumed.config_file.name == "config.resume-1.yaml" and again.config_file.name == "config.resume-2.yaml"
    assert resumed.rewards_file.name == "rewards.resume-1.json"
    assert "(resume 2, from ckpt/update-2)" in again.config_file.read_text()


def test_a_resume_into_a_new_directory_writes_config_yaml(tmp_path):
    run = open_run_directory(str(tmp_path / "new"), CONFIG, resume="elsewhere/update-3")
    assert run.segment == 0 and run.config_file.is_file()


def test_contradictions_and_a_file_as_out_dir_are_problems(tmp_path):
    (tmp_path / "file").write_text("x")
    problems = run_directory_problems(str(tmp_path / "file"), "ckpt", True)
    assert any("overwrite replaces the run in out_dir and resume continues it" in p for p in problems)
    assert any("is a file; give a directory" in p for p in problems)


def test_checkpoints_elsewhere_are_protected_too(tmp_path):
    checkpoints = tmp_path / "ckpts"
    (checkpoints / "update-4").mkdir(parents=True)
    (checkpoints / "keep.txt").write_text("x")
    (problem,) = run_directory_problems(str(tmp_path / "run"), None, False, str(checkpoints))
    assert f"checkpoint.dirpath {checkpoints} already holds checkpoints (update-4)" in problem
    open_run_directory(str(tmp_path / "run"), CONFIG, overwrite=True, checkpoint_dir=str(checkpoints))
    assert sorted(p.name for p in checkpoints.iterdir()) == ["keep.txt"]


def test_a_launched_rank_other_than_zero_checks_nothing_and_writes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("written by rank 0\n")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert run_directory_problems(str(out), None, False) == []
    assert open_run_directory(str(out), CONFIG, overwrite=True) == RunDirectory(out, 0)
    assert (out / "config.yaml").read_text() == "written by rank 0\n"


@pytest.mark.parametrize("link_target", ["file", "dir"])
def test_overwrite_removes_a_symlinked_output_not_its_target(tmp_path, link_target):
    target = tmp_path / "target"
    (target.mkdir() if link_target == "dir" else target.write_text("keep"))
    out = tmp_path / "run"
    out.mkdir()
    (out / "trace").symlink_to(target)
    open_run_directory(str(out), CONFIG, overwrite=True)
    assert not (out / "trace").exists() and target.exists()


def test_segments_follow_the_configs_on_disk(tmp_path):
    Path(tmp_path / "config.yaml").write_text("x")
    Path(tmp_path / "config.resume-7.yaml").write_text("x")
    assert open_run_directory(str(tmp_path), CONFIG, resume="r").segment == 8
