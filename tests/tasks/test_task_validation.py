"""``tslightning tasks validate``: every shipped task's reference passes and its no-op fails (App. C.2)."""

from __future__ import annotations

import shutil
import time

import pytest

from tslightning import cli
from tslightning.tasks.terminal_task import find_task_dirs
from tslightning.tasks.validation import format_table, library_dir, validate_task, validate_tasks


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
