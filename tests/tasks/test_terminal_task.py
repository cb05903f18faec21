"""Loading Harbor task directories: fields, limits, /app seeding, and errors that name the file and the key."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tslightning.sandbox import SandboxLimits
from tslightning.tasks.terminal_task import TaskFormatError, TaskFormatWarning, TerminalTask, find_task_dirs
from tslightning.tasks.validation import library_dir

PASSING_TEST_SH = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"


def _write_task(root, toml="", instruction="Do the thing.\n", test_sh=PASSING_TEST_SH):
    (root / "environment").mkdir(parents=True)
    (root / "tests").mkdir()
    if toml is not None:
        (root / "task.toml").write_text(toml)
    if instruction is not None:
        (root / "instruction.md").write_text(instruction)
    if test_sh is not None:
        (root / "tests" / "test.sh").write_text(test_sh)
    return root


def _problems(task_dir):
    with pytest.raises(TaskFormatError) as info:
        TerminalTask.load(task_dir)
    assert str(task_dir) in str(info.value)
    return info.value.problems


def test_shipped_library_has_thirty_loadable_tasks():
    task_dirs = find_task_dirs(library_dir())
    assert len(task_dirs) >= 30
    for task_dir in task_dirs:
        task = TerminalTask.load(task_dir)
        assert task.name == task_dir.name and task.solution_script is not None and task.dockerfile is not None
        assert len(task.instruction) < 300, f"{task.name}: keep instructions short for the small model's context"
        assert task.verifier.timeout_sec == 60.0 and task.environment.memory_mb == 1024


def test_library_is_found_through_importlib_resources():
    import tslightning.tasks

    assert library_dir() == Path(tslightning.tasks.__file__).parent / "library"
    assert (library_dir() / "count-lines" / "task.toml").is_file()


def test_harbor_fields_and_limits(tmp_path):
    toml = """
version = "1.0"
source = "seta"
[metadata]
difficulty = "hard"
tags = ["x"]
[verifier]
timeout_sec = 30
env = { MODE = "strict" }
[agent]
timeout_sec = 90.0
[environment]
build_timeout_sec = 100.0
docker_image = "python:3.11-slim"
cpus = 2
memory_mb = 512
storage_mb = 100
allow_internet = false
[solution]
env = { SEED = "1" }
"""
    task = TerminalTask.load(_write_task(tmp_path / "my-task", toml))
    assert task.name == "my-task" and task.instruction == "Do the thing.\n" and task.source == "seta"
    assert task.metadata == {"difficulty": "hard", "tags": ["x"]}
    assert task.verifier.timeout_sec == 30.0 and task.verifier.env == {"MODE": "strict"}
    assert task.agent.timeout_sec == 90.0 and task.solution_env == {"SEED": "1"}
    assert task.environment.cpus == 2 and task.environment.allow_internet is False
    assert task.verifier_limits() == SandboxLimits(
        timeout_s=30.0, cpu_seconds=60, memory_bytes=512 * 2**20, file_size_bytes=100 * 2**20, disk_bytes=100 * 2**20
    )
    # An agent command gets Table 6's 120 s, capped by the task's own agent timeout.
    assert task.agent_limits().timeout_s == 90.0 and task.agent_limits(60.0).timeout_s == 60.0


def test_empty_task_toml_takes_harbor_defaults(tmp_path):
    task = TerminalTask.load(_write_task(tmp_path / "t"))
    assert task.verifier.timeout_sec == 600.0 and task.agent.timeout_sec is None
    assert (task.environment.cpus, task.environment.memory_mb, task.environment.storage_mb) == (1, 2048, 10240)
    assert task.solution_script is None and task.dockerfile is None and task.agent_limits().timeout_s == 120.0


def test_deprecated_size_strings(tmp_path):
    task = TerminalTask.load(_write_task(tmp_path / "t", '[environment]\nmemory = "2G"\nstorage = "512M"\n'))
    assert task.environment.memory_mb == 2048 and task.environment.storage_mb == 512


def test_missing_instruction_names_the_file(tmp_path):
    assert _problems(_write_task(tmp_path / "t", instruction=None)) == [
        "instruction.md: missing (the agent's prompt is required)"
    ]


def test_missing_test_script_names_the_file(tmp_path):
    assert _problems(_write_task(tmp_path / "t", test_sh=None)) == [
        "tests/test.sh: missing (the verifier entrypoint is required)"
    ]


def test_bad_toml_names_the_file(tmp_path):
    (problem,) = _problems(_write_task(tmp_path / "t", "[verifier\ntimeout_sec = 1"))
    assert problem.startswith("task.toml: not valid TOML")


def test_wrong_types_name_the_key_all_at_once(tmp_path):
    toml = """
verison = "1.0"
[verifier]
timeout_sec = "fast"
timeout = 10
[environment]
cpus = 0
memory = "lots"
allow_internet = "no"
[agent]
timeout_sec = -1
"""
    problems = _problems(_write_task(tmp_path / "t", toml, instruction="  \n"))
    assert "instruction.md: empty" in problems
    assert "task.toml: [verifier] timeout_sec must be a positive number of seconds; got 'fast'" in problems
    assert "task.toml: [agent] timeout_sec must be a positive number of seconds; got -1" in problems
    assert "task.toml: [environment] cpus must be an integer ≥ 1; got 0" in problems
    assert "task.toml: [environment] memory must be a size such as '2G' or '512M'; got 'lots'" in problems
    assert "task.toml: [environment] allow_internet must be true or false; got 'no'" in problems
    assert len(problems) == 6  # the unknown keys (verison, [verifier] timeout) are warnings, not problems


def test_unknown_keys_warn_and_the_task_loads(tmp_path):
    toml = 'verison = "1.0"\nartifacts = []\n[verifier]\ntimeout = 10\n[environment]\nbuild_cache = true\n'
    with pytest.warns(TaskFormatWarning) as caught:
        task = TerminalTask.load(_write_task(tmp_path / "t", toml))
    assert task.warnings == (
        "task.toml: unknown key verison ignored (as Harbor does)",
        "task.toml: unknown key [verifier] timeout ignored (as Harbor does)",
        "task.toml: unknown key [environment] build_cache ignored (as Harbor does)",
    )
    assert len(caught) == 3 and task.artifacts == ()


def test_section_that_is_not_a_table(tmp_path):
    problems = _problems(_write_task(tmp_path / "t", 'verifier = "x"\n'))
    assert problems == ["task.toml: [verifier] must be a table; got 'x'"]


def test_not_a_directory(tmp_path):
    assert "is not a directory" in _problems(tmp_path / "absent")[0]


def test_app_seeding_skips_container_build_files(tmp_path):
    root = _write_task(tmp_path / "t")
    (root / "environment" / "Dockerfile").write_text("FROM debian\n")
    (root / "environment" / "data").mkdir()
    (root / "environment" / "data" / "Dockerfile").write_text("nested files are data\n")
    (root / "environment" / "input.txt").write_text("hello\n")
    task = TerminalTask.load(root)
    assert [str(relative) for _, relative in task.app_files()] == ["data/Dockerfile", "input.txt"]
    with task.open_attempt() as attempt:
        seeded = sorted(str(p.relative_to(attempt.app)) for p in attempt.app.rglob("*") if p.is_file())
        assert seeded == ["data/Dockerfile", "input.txt"]
        root_dir = attempt.root
    assert not root_dir.exists()


def test_find_task_dirs(tmp_path):
    single = _write_task(tmp_path / "lib" / "b")
    _write_task(tmp_path / "lib" / "a")
    (tmp_path / "lib" / "not-a-task").mkdir()
    assert find_task_dirs(single) == [single]
    assert [p.name for p in find_task_dirs(tmp_path / "lib")] == ["a", "b"]
    with pytest.raises(FileNotFoundError):
        find_task_dirs(tmp_path / "nope")


def test_shipped_task_toml_is_plain_harbor(tmp_path):
    config = tomllib.loads((library_dir() / "count-lines" / "task.toml").read_text())
    assert set(config) == {"version", "metadata", "verifier", "agent", "environment"}


def test_no_shipped_task_file_is_git_ignored():
    """A git-ignored file (say under a ``build/`` directory) would silently drop out of commits and wheels."""
    repo = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git checkout")
    files = "\n".join(str(path) for path in library_dir().rglob("*") if path.is_file())
    ignored = subprocess.run(
        ["git", "-C", str(repo), "check-ignore", "--stdin"], input=files, capture_output=True, text=True
    ).stdout
    assert ignored == ""
