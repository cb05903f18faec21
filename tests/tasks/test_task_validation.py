"""``tslightning tasks validate``: every shipped task's reference passes and its no-op fails (App. C.2)."""

from __future__ import annotations

import shutil
import time

import pytest

from tslightning import cli
from tslightning.tasks.terminal_task import find_task_dirs
from tslightning.tasks.validation import (
    format_table,
    library_dir,
    read_only_writes,
    validate_task,
    validate_tasks,
)


@pytest.fixture
def broken_library(tmp_path):
    """Three copies of count-lines: intact, with a wrong reference solution, with a verifier that passes anything."""
    for name in ("intact", "wrong-solution", "lenient-verifier"):
        shutil.copytree(library_dir() / "count-lines", tmp_path / name)
    (tmp_path / "wrong-solution" / "solution" / "solve.sh").write_text("#!/bin/bash\necho 136 > /app/count.txt\n")
    (tmp_path / "lenient-verifier" / "tests" / "test.sh").write_text(
        '#!/bin/bash\necho "looks fine"\necho \'{"tests_passed": 2, "tests_total": 2}\' > /logs/verifier/reward.json\n'
    )
    return tmp_path


def test_every_shipped_task_validates(capsys):
    """CI: all shipped tasks, each in fresh bubblewrap attempts, on 2 workers."""
    start = time.perf_counter()
    results = validate_tasks(workers=2)
    elapsed = time.perf_counter() - start
    assert len(results) == len(find_task_dirs(library_dir())) >= 30
    table = format_table(results)
    with capsys.disabled():
        print(f"\nvalidated {len(results)} shipped tasks in {elapsed:.1f} s")
    assert all(result.ok for result in results), table
    for result in results:
        assert result.reference.reward == 1.5 and result.noop.passed_fraction < 1.0, result.task
    assert f"{len(results)}/{len(results)} tasks valid" in table


def test_broken_reference_and_lenient_verifier_are_named(broken_library):
    results = {result.task: result for result in validate_tasks(broken_library)}
    assert results["intact"].ok
    (wrong,) = results["wrong-solution"].problems
    assert wrong.startswith("reference solution scored 0.75 (expected 1.5): 3/4 tests passed (reward.json)")
    assert "FAIL: count.txt holds the line count" in wrong  # the verifier output's tail
    (lenient,) = results["lenient-verifier"].problems
    assert lenient.startswith("no-op agent already passes (2/2 tests passed (reward.json))")
    table = format_table(list(results.values()))
    assert "1/3 tasks valid" in table and "wrong-solution" in table and "FAIL" in table


def test_solution_failure_and_format_errors_are_reported(tmp_path):
    shutil.copytree(library_dir() / "count-lines", tmp_path / "crashing")
    (tmp_path / "crashing" / "solution" / "solve.sh").write_text("echo partial > /app/count.txt\nexit 7\n")
    (crashing,) = validate_task(tmp_path / "crashing").problems
    assert "reference solution scored" in crashing and "solution/solve.sh exited 7" in crashing
    shutil.copytree(library_dir() / "count-lines", tmp_path / "no-instruction")
    (tmp_path / "no-instruction" / "instruction.md").unlink()
    assert validate_task(tmp_path / "no-instruction").problems == (
        "instruction.md: missing (the agent's prompt is required)",
    )
    shutil.copytree(library_dir() / "count-lines", tmp_path / "no-solution")
    shutil.rmtree(tmp_path / "no-solution" / "solution")
    assert validate_task(tmp_path / "no-solution").problems == ("no solution/solve.sh to validate against",)


def test_cli_validate_fails_naming_the_task(broken_library, capsys):
    shutil.rmtree(broken_library / "lenient-verifier")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tasks", "validate", str(broken_library), "--workers", "1"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "wrong-solution" in captured.out and "reference solution scored 0.75 (expected 1.5)" in captured.out
    assert "tasks validate: 1 invalid task(s): wrong-solution" in captured.err


def test_cli_validate_one_task_passes(capsys):
    cli.main(["tasks", "validate", "--path", str(library_dir() / "base64-decode"), "--scheme", "binary"])
    out = capsys.readouterr().out
    assert "base64-decode" in out and "p=1.00 r=1.00" in out and "1/1 tasks valid" in out


def test_cli_validate_missing_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tasks", "validate", str(tmp_path / "absent")])
    assert exit_info.value.code == 2 and "is not a directory" in capsys.readouterr().err


def test_writes_the_read_only_root_refused_are_found_in_any_tools_words():
    output = (
        "E   OSError: [Errno 30] Read-only file system: '/data'\n"
        "mkdir: cannot create directory '/output': Read-only file system\n"
        "touch: cannot touch ‘/srv/flag’: Read-only file system\n"  # coreutils' quotes in a UTF-8 locale
        "/entrypoint.sh: line 4: /etc/motd: Read-only file system\n"
        "PytestCacheWarning: could not create cache path /tests/.pytest_cache/v: [Errno 30] Read-only file system: "
        "'/tests/pytest-cache-files-x1'\n"  # /tests is read-only by design: a warning, not the failure
        "E   OSError: [Errno 30] Read-only file system: '/data'\n"
    )
    assert read_only_writes(output) == ["/data", "/output", "/srv/flag", "/etc/motd"]
    assert read_only_writes("FAILED test_x.py::test_y - AssertionError: 0 != 1") == []


def test_a_reference_failed_by_the_read_only_root_needs_the_image(tmp_path):
    """Terminal-Bench 1 tests often write at the top of the root (/data, /output), which a container allows."""
    task = tmp_path / "top-level-output"
    for name in ("environment", "solution", "tests"):
        (task / name).mkdir(parents=True)
    (task / "task.toml").write_text('version = "1.0"\n')
    (task / "instruction.md").write_text("Write the word done to /results/out.txt.\n")
    (task / "environment" / "Dockerfile").write_text("FROM python:3.12-slim-bookworm\nWORKDIR /app\n")
    (task / "solution" / "solve.sh").write_text("#!/bin/bash\nmkdir -p /results && echo done > /results/out.txt\n")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\ngrep -qx done /results/out.txt && echo 1 > /logs/verifier/reward.txt "
        "|| echo 0 > /logs/verifier/reward.txt\n"
    )
    result = validate_task(task)
    assert result.status == "needs image", result.problems
    assert result.problems[0].startswith("the reference's run wrote to /results, read-only here")
    assert result.reference.passed_fraction == 0.0  # still shown: what the attempt scored, and why
