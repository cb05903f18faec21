"""Which tasks a run trains on: the named ones only, the split's side, and every problem named with its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from tslightning.loop.settings import InvalidSettingsError, RolloutSettings
from tslightning.loop.task_selection import select_tasks, training_tasks
from tslightning.tasks.validation import library_dir


def _task(root: Path, name: str, toml: str = "") -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "tests" / "test.sh").write_text("exit 0\n")
    (task / "instruction.md").write_text("Do it.\n")
    (task / "task.toml").write_text(toml)
    return task


def test_named_tasks_are_the_only_ones_loaded(tmp_path):
    _task(tmp_path, "good")
    _task(tmp_path, "broken", "[verifier]\ntimeout_sec = -1\n")
    chosen = select_tasks(RolloutSettings(tasks=str(tmp_path), task_names=["good"], split="all"))
    assert [t.name for t in chosen.tasks] == ["good"] and chosen.problems == [] and chosen.missing == []
    every = select_tasks(RolloutSettings(tasks=str(tmp_path), split="all"))
    (problem,) = every.problems
    assert f"rollout.tasks: task 'broken' ({tmp_path / 'broken'}) is not a valid Harbor task: task.toml" in problem
    assert "leave it out with rollout.task_names" in problem


def test_unknown_names_missing_and_empty_directories_are_named(tmp_path):
    unknown = select_tasks(RolloutSettings(task_names=["count-lines", "nope"], split="all"))
    assert unknown.problems == [
        f"rollout.task_names ['nope'] are not tasks in {library_dir()} (it has base64-decode, compute-checksum, "
        "count-lines, count-unique-ips, create-directory-tree, crlf-to-lf, ... (36 in all))"
    ]
    missing = select_tasks(RolloutSettings(tasks=str(tmp_path / "nowhere")))
    assert missing.problems == [] and "is not a directory" in missing.missing[0]
    empty = select_tasks(RolloutSettings(tasks=str(tmp_path)))
    assert empty.problems == [f"rollout.tasks {tmp_path} holds no task (a directory with task.toml); point it at one"]
    with pytest.raises(InvalidSettingsError, match="rollout.task_names"):
        training_tasks(RolloutSettings(task_names=["nope"]))


def test_multi_step_tasks_are_refused_by_name(tmp_path):
    multi = _task(tmp_path, "multi", '[[steps]]\nname = "one"\n')
    (multi / "steps" / "one").mkdir(parents=True)
    (multi / "steps" / "one" / "instruction.md").write_text("Step one.\n")
    _task(tmp_path, "single")
    selection = select_tasks(RolloutSettings(tasks=str(tmp_path), split="all"))
    assert [t.name for t in selection.tasks] == ["single"]
    (problem,) = selection.problems
    assert problem.startswith("rollout.tasks: task 'multi' is a multi-step task ([[steps]]), which fit does not train")
    assert RolloutSettings(reward_key="").problems() == [
        "rollout.reward_key is empty: name the reward.json key to train on (default: reward)"
    ]
