"""Compose tasks without a container engine: helper services as image-lite roots in the attempt's own network, the
public Harbor cookbook tasks with helpers validated, and what the agent and its helpers cannot reach of each other.

Builds go through the shared test cache (the Debian bases once, then each image once); the cookbook's verifiers
run the Terminal-Bench 2 template, served by the offline toolchain filled with what the tasks name. Skipped, saying
why, where the builder cannot run (not root, no mmdebstrap).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tslightning import cli
from tslightning.sandbox.errors import SandboxError
from tslightning.tasks.environment.helper_services import HELPER_UID
from tslightning.tasks.environment.image_lite import builder_problem
from tslightning.tasks.environment.offline_toolchain import fill_wheel_cache, prepare_toolchain, requirements_of
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import validate_task

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
SERVICES = FIXTURES / "harbor_tasks" / "compose-services"
COOKBOOK = FIXTURES / "harbor_cookbook"
CACHE = Path(tempfile.gettempdir()) / "tslightning-test-cache"


@pytest.fixture(scope="module")
def builder() -> Path:
    problem = builder_problem()
    if problem is not None:
        pytest.skip(problem)
    return CACHE


@pytest.fixture
def cached(builder, monkeypatch) -> Path:
    monkeypatch.setenv("TSLIGHTNING_CACHE_DIR", str(builder))
    return builder


@pytest.fixture(scope="module")
def cookbook_toolchain(builder) -> Path:
    """The offline toolchain with what the cookbook tasks install (pytest pins; fastmcp, mcp for the MCP task)."""
    toolchain = prepare_toolchain(builder)
    fill_wheel_cache(toolchain, requirements_of([COOKBOOK]), timeout_s=600)
    return builder


def test_helper_services_start_in_order_and_the_verifier_reaches_them_and_the_agents_server(cached):
    result = validate_task(SERVICES)
    assert result.status == "valid", result.problems
    assert result.noop.passed_fraction == 0.0 and result.reference.passed
    assert list(result.services) == ["seed", "kv"] and result.services["kv"] > 1.0  # healthy after its warm-up
    assert "'kv by name': '42'" in result.reference.output and "\"agent's server\": '42'" in result.reference.output


def test_tasks_validate_reports_each_helpers_start_up_seconds(cached, tmp_path, capsys):
    shutil.copytree(SERVICES, tmp_path / "compose-services")
    shutil.copytree(COOKBOOK / "simulated-user", tmp_path / "simulated-user")
    with pytest.raises(SystemExit):
        cli.main(["tasks", "validate", str(tmp_path), "--workers", "1"])
    out = capsys.readouterr().out
    assert "helper services (start-up s: until healthy, or started without a healthcheck):" in out
    assert "  compose-services: seed " in out and ", kv " in out
    assert "simulated-user" in out and "needs model API" in out and "ANTHROPIC_API_KEY" in out


@pytest.mark.slow
def test_the_cookbook_api_server_task_validates(cookbook_toolchain, cached):
    result = validate_task(COOKBOOK / "multi-container")
    assert result.status == "valid", result.problems
    assert result.noop.passed_fraction == 0.0 and result.reference.passed_fraction == 1.0
    assert list(result.services) == ["api-server"] and result.build_s is not None


@pytest.mark.slow
def test_the_cookbook_mcp_task_runs_its_mcp_server_offline(cookbook_toolchain, cached, tmp_path):
    """mcp-tools' helper (astral's uv image, `uv run server.py` with inline dependencies) starts offline from the
    toolchain's wheels. Its reference solution, as published, imports `streamablehttp_client`, which mcp 2 (the
    newest, as Harbor's online uv would also resolve) no longer has; with that one import renamed it validates."""
    task = TerminalTask.load(COOKBOOK / "mcp-tools")
    with TerminalTaskAttempt(task) as attempt:
        assert attempt.services.startup_s["mcp-server"] > 0
        solved = attempt.run_solution()
    assert solved.exit_code == 1 and "cannot import name 'streamablehttp_client'" in solved.output
    patched = shutil.copytree(COOKBOOK / "mcp-tools", tmp_path / "mcp-tools")
    solve = patched / "solution" / "solve.sh"
    text = solve.read_text().replace(
        "import streamablehttp_client", "import streamable_http_client as streamablehttp_client"
    )
    solve.write_text(text.replace("as (read, write, _):", "as (read, write):"))
    result = validate_task(patched)
    assert result.status == "valid", result.problems
    assert result.noop.passed_fraction == 0.0 and result.reference.passed_fraction == 1.0


def test_a_helper_that_needs_a_model_api_is_refused_before_any_build():
    result = validate_task(COOKBOOK / "simulated-user")
    assert result.status == "needs model API" and result.noop is None and result.reference is None
    assert "services.user-server.environment: ANTHROPIC_API_KEY" in result.problems[0]


def test_an_unhealthy_helper_fails_the_start_naming_it_and_its_log(cached, tmp_path):
    task_dir = shutil.copytree(SERVICES, tmp_path / "unhealthy")
    compose = task_dir / "environment" / "docker-compose.yaml"
    text = compose.read_text().replace("retries: 10", "retries: 2").replace("start_period: 10s", "start_period: 0s")
    compose.write_text(text.replace("/health', timeout=2)", "/nowhere', timeout=2)"))
    with pytest.raises(SandboxError, match="helper service 'kv' is unhealthy: its healthcheck failed 2 times"):
        TerminalTaskAttempt(TerminalTask.load(task_dir))
    result = validate_task(task_dir)
    assert result.status == "invalid" and result.problems[0].startswith("the environment did not start: helper")


def test_an_agent_in_main_cannot_reach_a_helpers_files_or_processes(cached):
    task = TerminalTask.load(SERVICES)
    with TerminalTaskAttempt(task) as attempt:
        kv = attempt.services.sandboxes["kv"]
        assert kv.run("cat /app/kv-secret.txt").output == "only the kv service has this file\n"
        probe = attempt.run_command(
            "cat /app/kv-secret.txt; find / -name kv-secret.txt -o -name kv.py 2>/dev/null; "
            "cat /proc/[0-9]*/root/app/kv-secret.txt 2>/dev/null; ls /proc | grep -c '^[0-9]'; "
            "pkill -9 -f kv.py; kill -9 -1; "
            "python3 -c \"import urllib.request as u; print(u.urlopen('$KV_URL/answer').read().decode())\""
        )
        assert "only the kv service" not in probe.output and "kv.py" not in probe.output.replace("-f kv.py", "")
        assert probe.output.splitlines()[-1] == "42"  # what it can do: talk to the service over the network
        assert kv.run("python3 -c \"import urllib.request as u; u.urlopen('http://localhost:8080/health')\"").ok
        attempt.run_command("echo mine > /app/agent-secret.txt")
        seen = kv.run("cat /app/agent-secret.txt /proc/[0-9]*/root/app/agent-secret.txt 2>/dev/null; ls -A /app")
        assert seen.output == "kv-secret.txt\nkv.py\n"  # nor can the helper reach the agent's files
    processes = [int(pid) for pid in os.listdir("/proc") if pid.isdigit()]
    assert not [pid for pid in processes if _uid(pid) == HELPER_UID]


def test_a_helper_cannot_outlive_the_attempt(cached):
    task = TerminalTask.load(SERVICES)
    attempt = TerminalTaskAttempt(task)
    helpers = attempt.services
    directories = [directory.root for directory in helpers.attempts.values()]
    network = helpers.network.inode()
    daemons = [pid for pid in _host_pids() if _uid(pid) == HELPER_UID and _comm(pid) == "sleep"]
    assert daemons  # kv.py's detached `sleep infinity`, in a session of its own
    attempt.close()
    assert not [pid for pid in _host_pids() if _uid(pid) == HELPER_UID]
    assert not [pid for pid in _host_pids() if _netns(pid) == network]  # nothing is left in the attempt's network
    assert not any(directory.exists() for directory in directories) and helpers.network.closed


def _host_pids() -> list[int]:
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit()]


def _uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _netns(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


@pytest.mark.slow
def test_fit_runs_two_updates_on_a_compose_task(cached, tmp_path):
    """The trainer's own loop: every attempt of every update gets its helper services, and they end with it."""
    shutil.copytree(SERVICES, tmp_path / "tasks" / "compose-services")
    out = tmp_path / "run"
    small = ["--updates", "2", "--warm_start.steps", "0", "--rollout.prompts_per_update", "1"]
    small += ["--rollout.samples_per_prompt", "2", "--rollout.max_turns", "2", "--rollout.max_tokens_per_turn", "24"]
    tasks = ["--rollout.tasks", str(tmp_path / "tasks"), "--rollout.task_names", "null", "--rollout.split", "all"]
    cli.main(["fit", "--config", "quickstart", *small, *tasks, "--checkpoint.enabled", "false"] + [
        "--progress", "false", "--out_dir", str(out)
    ])  # fmt: skip
    rewards = json.loads((out / "rewards.json").read_text())
    assert len(rewards["mean_rewards"]) == 2
    assert not [pid for pid in _host_pids() if _uid(pid) == HELPER_UID]
