"""The Harbor-shaped fixture tasks validate, or are refused with the reason their environment gives (never a 0)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tslightning import cli
from tslightning.tasks import validation
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import validate_task

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_tasks"


def test_named_rewards_train_on_the_chosen_key():
    result = validate_task(FIXTURES / "named-rewards", reward_key="correctness")
    assert result.status == "valid", result.problems
    assert result.reference.reading.named == {"correctness": 1.0, "performance": 0.5}
    assert "correctness 1 (reward.json)" in result.reference.reason and result.noop.passed_fraction == 0.0
    assert result.setup_s is not None and result.build_s is None


def test_named_rewards_without_a_chosen_key_say_which_to_choose():
    result = validate_task(FIXTURES / "named-rewards")
    assert result.status == "invalid"
    assert "named rewards ['correctness', 'performance'] but no 'reward'" in result.problems[0]


def test_named_rewards_all_full_validate_without_a_chosen_key(tmp_path):
    """Harbor's multi-reward recipe: the reference earns every named reward in full, so the task is valid as it is."""
    task = shutil.copytree(FIXTURES / "named-rewards", tmp_path / "both-full")
    (task / "tests" / "test.sh").write_text(
        "#!/bin/bash\nmkdir -p /logs/verifier\n"
        "if [ -s /app/primes.txt ]; then done=1; else done=0; fi\n"
        'printf \'{"correctness": %s, "performance": 1}\\n\' "$done" > /logs/verifier/reward.json\n'
    )
    result = validate_task(task)
    assert result.status == "valid", result.problems
    assert result.reference.reason.startswith("every named reward (correctness 1, performance 1)")
    assert result.noop.passed_fraction == 0.0


@pytest.mark.parametrize(
    ("name", "status", "reason"),
    [
        ("helper-db", "needs image", "docker-compose.yaml: services.db.image postgres:16 (no Debian root stands in"),
        ("service-build", "needs image", "Dockerfile:3: RUN apt-get update && apt-get install -y"),
    ],
)
def test_environments_that_cannot_run_here_are_named_not_scored(name, status, reason, monkeypatch):
    monkeypatch.setattr(validation, "builder_problem", lambda: "image-lite builds need mmdebstrap")  # none here
    result = validate_task(FIXTURES / name)
    assert result.status == status and any(reason in problem for problem in result.problems), result.problems
    assert result.reference is None and result.noop is None  # no attempt ran: nothing "scored 0"


def test_service_build_reads_what_its_image_provides():
    task = TerminalTask.load(FIXTURES / "service-build")
    assert task.needs.status == "build" and task.workdir == "/srv/work"
    assert task.command_env["KV_KEY"] == "answer" and task.needs.start_command == "python3 /opt/kv/kv_server.py"
    reasons = " | ".join(task.needs.reasons)
    assert "WORKDIR /srv/work" in reasons and "COPY conf/kv.conf /etc/kv/kv.conf" in reasons


def test_tb2_task_toml_loads_with_its_keys_honoured(monkeypatch):
    monkeypatch.setenv("TSL_FIXTURE_REPORT_NAME", "sum.txt")
    task = TerminalTask.load(FIXTURES / "tb2-uvx-template")
    assert task.artifacts == () and task.environment.docker_image == "alexgshaw/tb2-csv-total:20251031"
    assert task.command_env == {"REPORT_NAME": "sum.txt"} and task.verifier.env == {"EXPECTED_TOTAL": "42"}
    assert task.needs.status == "host" and task.warnings == ()


def test_cli_names_what_each_task_needs(tmp_path, capsys):
    for name in ("helper-db", "named-rewards"):
        shutil.copytree(FIXTURES / name, tmp_path / name)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["tasks", "validate", str(tmp_path), "--reward_key", "correctness", "--workers", "1"])
    assert exit_info.value.code == 1
    captured = capsys.readouterr()
    assert "services.db.image postgres:16" in captured.out and "build s" in captured.out and "setup s" in captured.out
    assert "1/2 tasks valid" in captured.out and "by status: needs image 1, valid 1" in captured.out
    assert "tasks validate: 1 task(s) cannot run here: helper-db (needs image)" in captured.err
    assert "invalid task(s)" not in captured.err


def test_a_service_the_reference_leaves_running_is_checked_by_the_verifier():
    result = validate_task(FIXTURES / "loopback-service")
    assert result.status == "valid", result.problems
    assert result.reference.passed_fraction == 1.0 and result.noop.passed_fraction == 0.0
