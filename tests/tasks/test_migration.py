"""``tslightning tasks migrate``: a Terminal-Bench 1 task (task.yaml, run-tests.sh, solution.sh) in Harbor's layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tslightning import cli
from tslightning.tasks.harbor.migration import MigrationError, migrate_tasks
from tslightning.tasks.terminal_task import TerminalTask

TB1 = Path(__file__).resolve().parents[1] / "fixtures" / "terminal_bench_1"


def test_a_terminal_bench_1_task_becomes_a_loadable_harbor_task(tmp_path):
    (migration,) = migrate_tasks(TB1, tmp_path / "out")
    target = tmp_path / "out" / "word-count"
    assert migration.target == target
    files = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert files == [
        "environment/Dockerfile",
        "environment/input.txt",
        "instruction.md",
        "solution/solve.sh",
        "task.toml",
        "tests/run-tests.sh",
        "tests/run-uv-pytest.sh",
        "tests/setup-uv-pytest.sh",
        "tests/test.sh",
        "tests/test_outputs.py",
    ]  # the harness's one-service compose file is dropped
    task = TerminalTask.load(target)
    assert task.instruction.startswith("Count the words in /app/input.txt") and task.warnings == ()
    assert task.agent.timeout_sec == 180.0 and task.verifier.timeout_sec == 120.0
    assert task.verifier.env == {"TEST_DIR": "/tests"}
    assert task.metadata["tags"] == ["wc", "migration"] and task.metadata["migrated_from"] == "terminal-bench-1"
    assert task.metadata["expert_time_estimate_min"] == 1.0
    assert "bash /tests/run-tests.sh" in (target / "tests" / "test.sh").read_text()
    assert "uv pip install pytest==8.4.1" in (target / "tests" / "setup-uv-pytest.sh").read_text()
    assert any("setup-uv-pytest.sh" in note for note in migration.notes)


def test_nothing_is_overwritten_and_problems_are_named(tmp_path):
    migrate_tasks(TB1 / "word-count", tmp_path)
    with pytest.raises(MigrationError, match="exist already"):
        migrate_tasks(TB1 / "word-count", tmp_path)
    broken = tmp_path / "src" / "broken"
    shutil.copytree(TB1 / "word-count", broken)
    (broken / "task.yaml").write_text("author_name: someone\n")
    with pytest.raises(MigrationError, match="has no instruction"):
        migrate_tasks(broken, tmp_path / "new")
    assert not (tmp_path / "new").exists()  # refused before writing
    with pytest.raises(MigrationError, match="holds no Terminal-Bench 1 task"):
        migrate_tasks(tmp_path / "src" / "broken" / "tests", tmp_path / "new")


def test_older_forms_and_helper_services(tmp_path):
    source = tmp_path / "src" / "old"
    shutil.copytree(TB1 / "word-count", source)
    (source / "task.yaml").write_text("descriptions:\n  - key: base\n    description: Do the old thing.\n")
    (source / "solution.sh").unlink()
    (source / "solution.yaml").write_text("- command: echo one > /app/a\n- command: echo two >> /app/a\n")
    compose = (source / "docker-compose.yaml").read_text()
    (source / "docker-compose.yaml").write_text(compose + "  redis:\n    image: redis:7\n")
    (migration,) = migrate_tasks(source, tmp_path / "out")
    target = tmp_path / "out" / "old"
    assert (target / "instruction.md").read_text() == "Do the old thing.\n"
    assert (target / "solution" / "solve.sh").read_text() == "#!/bin/bash\necho one > /app/a\necho two >> /app/a\n"
    assert (target / "environment" / "docker-compose.yaml").is_file()
    assert any("needs helper containers" in note and "redis" in note for note in migration.notes)
    task = TerminalTask.load(target)
    assert task.agent.timeout_sec == 360.0 and task.verifier.timeout_sec == 60.0  # Terminal-Bench 1's defaults


def test_cli_migrate_takes_two_positional_directories(tmp_path, capsys):
    cli.main(["tasks", "migrate", str(TB1), str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert f"migrated {TB1 / 'word-count'} -> {tmp_path / 'out' / 'word-count'}" in out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tasks", "migrate", str(TB1), str(tmp_path / "out")])
    assert exit_info.value.code == 2 and "exist already" in capsys.readouterr().err


def test_a_task_without_run_tests_gets_the_harness_default_runner(tmp_path):
    """Terminal-Bench 1 runs its default runner (uv, pytest on tests/test_outputs.py) for a task with no
    run-tests.sh: the migrated task does the same, with the two helpers beside it."""
    source = tmp_path / "src" / "default-runner"
    shutil.copytree(TB1 / "word-count", source)
    (source / "run-tests.sh").unlink()
    (migration,) = migrate_tasks(source, tmp_path / "out")
    tests = tmp_path / "out" / "default-runner" / "tests"
    runner = (tests / "run-tests.sh").read_text()
    assert 'source "$TEST_DIR/setup-uv-pytest.sh"' in runner and 'bash "$TEST_DIR/run-uv-pytest.sh"' in runner
    assert 'uv run pytest "$TEST_DIR/test_outputs.py" -rA' in (tests / "run-uv-pytest.sh").read_text()
    assert (tests / "setup-uv-pytest.sh").is_file() and (tests / "test_outputs.py").is_file()
    assert any("default runner" in note for note in migration.notes)
    assert not (source / "tests" / "run-tests.sh").exists()  # the source is never changed
