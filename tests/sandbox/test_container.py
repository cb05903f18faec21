"""Container backends through a fake engine CLI that records every call (no engine runs on these machines).

The fake answers ``info``, ``run``, ``image inspect`` / ``build`` (remembering built tags), ``cp`` (into a directory
standing in for the container) and ``exec``: a command's ``/bin/bash -c`` runs on the host, so output and exit codes
come back through the real ``supervise`` path; everything else is recorded only. With a real engine present, the same
code path runs against it (not here: ``docker info`` has no engine to answer, and podman cannot set rlimits here).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tslightning.sandbox import AttemptDirectory, ContainerSandbox, SandboxLimits, SandboxUnavailableError
from tslightning.sandbox import container as container_module
from tslightning.tasks.environment.container_image import container_image, context_digest
from tslightning.tasks.task_attempt import TerminalTaskAttempt, sandbox_factory
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import unmet_needs, validate_task

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_tasks"
COOKBOOK = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_cookbook"

FAKE = textwrap.dedent(
    """\
    #!{python}
    import json, os, shutil, subprocess, sys
    state = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[0]))), "state")
    args = sys.argv[1:]
    with open(os.path.join(state, "calls.jsonl"), "a") as log:
        log.write(json.dumps([os.path.basename(sys.argv[0]), *args]) + "\\n")
    fail = os.environ.get("FAKE_ENGINE_FAIL", "")
    if args[0] == fail:
        sys.exit("fake engine: " + fail + " refused")
    root = os.path.join(state, "container")
    def inside(path):
        return os.path.join(root, path.split(":", 1)[1].lstrip("/")) if ":" in path else path
    if args[0] == "compose" and args[-1] == "version":
        sys.exit(1 if os.environ.get("FAKE_NO_COMPOSE") else 0)
    elif args[0] == "compose" and "up" in args:
        override = args[[i for i, a in enumerate(args) if a == "--file"][-1] + 1]
        shutil.copy(override, os.path.join(state, "override.json"))
        with open(os.path.join(state, "compose_env.json"), "w") as env_file:
            json.dump({{name: os.environ.get(name) for name in ("CPUS", "MEMORY", "CONTEXT_DIR")}}, env_file)
    elif args[0] == "run":
        print("0123456789ab")
    elif args[:2] == ["image", "inspect"]:
        sys.exit(0 if os.path.exists(os.path.join(state, "built", args[2].replace("/", "_"))) else 1)
    elif args[0] == "build":
        open(os.path.join(state, "built", args[2].replace("/", "_")), "w").close()
    elif args[0] == "cp":
        source, target = inside(args[1]), inside(args[2])
        shutil.copytree(source.rstrip("."), target, dirs_exist_ok=True)
    elif args[0] == "exec" and "--detach" not in args and "/bin/bash" in args:
        with open(args[args.index("--env-file") + 1]) as env_file:
            if not os.path.exists(os.path.join(state, "first.env")):
                shutil.copy(env_file.name, os.path.join(state, "first.env"))
            os.environ.update(line.rstrip("\\n").split("=", 1) for line in env_file)
        rest = args[args.index("/bin/bash"):]
        rest[2] = rest[2].replace("/tmp/", os.path.join(state, "tmp") + "/")
        os.execv(rest[0], rest)
    """
)


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """A fake ``docker`` and ``podman`` first on PATH; returns the recorded calls' reader."""
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    for directory in (bin_dir, state / "built", state / "tmp", state / "container"):
        directory.mkdir(parents=True)
    for name in ("docker", "podman"):
        (bin_dir / name).write_text(FAKE.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")

    def calls() -> list[list[str]]:
        path = state / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    calls.state = state
    return calls


def test_one_container_per_attempt_and_one_exec_per_command(engine):
    limits = SandboxLimits(timeout_s=20, memory_bytes=2**30, max_processes=64)
    with AttemptDirectory() as attempt:
        sandbox = ContainerSandbox(attempt, image="python:3.12", engine="podman", limits=limits, cpus=2,
                                   start_command="python3 -m http.server", workdir="/srv")  # fmt: skip
        first = sandbox.run("echo hi; echo $GREETING", env={"GREETING": "hello"}, cwd="/srv")
        second = sandbox.run("exit 3")
        sandbox.close()
    assert first.output == "hi\nhello\n" and first.exit_code == 0 and second.exit_code == 3
    calls = engine()
    runs = [call for call in calls if call[1] == "run"]
    assert len(runs) == 1 and runs[0][0] == "podman"
    run = runs[0]
    for flag, value in (("--network", "none"), ("--memory", str(2**30)), ("--memory-swap", str(2**30)),
                        ("--pids-limit", "64"), ("--cpus", "2"), ("--entrypoint", "sleep")):  # fmt: skip
        assert run[run.index(flag) + 1] == value, flag
    assert run[-2:] == ["python:3.12", "infinity"] and "--init" in run
    name = run[run.index("--name") + 1]
    assert ["podman", "exec", "--detach", "--workdir", "/srv", name, "/bin/sh", "-c", "python3 -m http.server"] in calls
    execs = [call for call in calls if call[1] == "exec" and "/bin/bash" in call]
    assert len(execs) == 2 and execs[0][2:4] == ["--workdir", "/srv"] and execs[0][4] == "--env-file"
    assert execs[0][6:8] == [name, "/bin/bash"] and "hello" not in " ".join(execs[0])  # not in the process list
    assert "GREETING=hello\n" in (engine.state / "first.env").read_text()
    assert execs[0][-1] == "echo hi; echo $GREETING" and calls[-1] == ["podman", "rm", "-f", name]


def test_a_verifier_run_copies_tests_in_and_logs_out(engine):
    with AttemptDirectory() as attempt:
        (attempt.tests / "test.sh").write_text("echo 1\n")
        sandbox = ContainerSandbox(attempt, image="debian", engine="docker")
        container_logs = engine.state / "container" / "logs" / "verifier"
        container_logs.mkdir(parents=True)
        (container_logs / "reward.txt").write_text("1\n")  # what the verifier left in the container
        sandbox.run("true", mounts=("app", "tests", "logs"), verifier=True)
        assert (attempt.logs / "reward.txt").read_text() == "1\n"
        assert (engine.state / "container" / "tests" / "test.sh").is_file()
        sandbox.close()
        tests, logs = attempt.tests, attempt.logs
    name = sandbox.name
    calls = [call[1:] for call in engine()]
    copy_in = calls.index(["cp", f"{tests}/.", f"{name}:/tests"])
    assert calls[copy_in - 1] == ["exec", name, "rm", "-rf", "/tests"]
    reset = calls.index(["exec", name, "sh", "-c", "rm -rf /logs/verifier && mkdir -p /logs/verifier"])
    command = next(i for i, call in enumerate(calls) if "/bin/bash" in call)
    assert copy_in < reset < command < calls.index(["cp", f"{name}:/logs/verifier/.", str(logs)])


def test_a_timed_out_command_is_killed_inside_the_container(engine):
    with AttemptDirectory() as attempt:
        sandbox = ContainerSandbox(attempt, image="debian")
        result = sandbox.run("sleep 30", limits=SandboxLimits(timeout_s=1))
        sandbox.close()
    assert result.timed_out
    kills = [call for call in engine() if call[1] == "exec" and "sh" in call and "pkill" in call[-1]]
    assert len(kills) == 1 and "/tmp/.tsl-command-1.pid" in kills[0][-1]


def test_the_container_is_removed_on_every_exit_path(engine, monkeypatch):
    with AttemptDirectory() as attempt:
        monkeypatch.setenv("FAKE_ENGINE_FAIL", "run")
        failing = ContainerSandbox(attempt, image="debian")
        with pytest.raises(Exception, match="fake engine: run refused"):
            failing.run("true")
        assert engine()[-1] == ["docker", "rm", "-f", failing.name]  # a failed start leaves nothing
        monkeypatch.delenv("FAKE_ENGINE_FAIL")
        left = ContainerSandbox(attempt, image="debian")
        left.run("true")
        container_module._remove_running()  # what runs at the trainer's exit
        assert engine()[-1] == ["docker", "rm", "-f", left.name]
        left.close()  # idempotent: no second rm
        assert engine()[-1] == ["docker", "rm", "-f", left.name]


def test_no_engine_is_unavailable_with_the_fix(engine, monkeypatch):
    monkeypatch.setenv("FAKE_ENGINE_FAIL", "info")
    with AttemptDirectory() as attempt, pytest.raises(SandboxUnavailableError, match="needs a running engine"):
        ContainerSandbox(attempt, image="debian")


def test_task_images_are_pulled_or_built_once_per_content(engine, tmp_path):
    service = TerminalTask.load(FIXTURES / "service-build")
    tag = f"tslightning-task/service-build:{context_digest(service.environment_dir)}"
    assert container_image(service, "docker") == tag
    assert container_image(service, "docker") == tag
    builds = [call for call in engine() if call[1] == "build"]
    assert builds == [
        ["docker", "build", "--tag", tag, "--file", str(service.dockerfile), str(service.environment_dir)]
    ]
    tb2 = TerminalTask.load(FIXTURES / "tb2-uvx-template")
    assert container_image(tb2, "docker") == "alexgshaw/tb2-csv-total:20251031"  # the prebuilt image, as Harbor


def test_an_attempt_runs_in_the_tasks_container(engine):
    task = TerminalTask.load(FIXTURES / "service-build")
    with TerminalTaskAttempt(task, make_attempt_sandbox=sandbox_factory("podman"), toolchain=None) as attempt:
        assert isinstance(attempt.sandbox, ContainerSandbox) and attempt.image is None
        assert attempt.run_command("echo $KV_KEY").output == "answer\n"
        name = attempt.sandbox.name
    calls = engine()
    run = next(call for call in calls if call[1] == "run")
    assert run[-2].startswith("tslightning-task/service-build:")
    assert ["podman", "exec", "--detach", "--workdir", "/srv/work", name, "/bin/sh", "-c",
            "python3 /opt/kv/kv_server.py"] in calls  # fmt: skip
    assert calls[-1] == ["podman", "rm", "-f", name]


def test_helper_containers_run_with_compose_where_the_engine_has_it(engine):
    task = TerminalTask.load(FIXTURES / "helper-db")
    assert unmet_needs(task, "docker") is None  # `docker compose version` answers; the engine pulls postgres:16
    with TerminalTaskAttempt(task, make_attempt_sandbox=sandbox_factory("docker"), toolchain=None) as attempt:
        assert attempt.run_command("echo in main").output == "in main\n"
        name, override = attempt.sandbox.name, attempt.attempt.root / ".tsl-compose-override.json"
        project = ["--project-name", name, "--project-directory", str(task.environment_dir)]
        files = ["--file", str(task.compose_file), "--file", str(override)]
    calls = engine()
    assert ["docker", "compose", *project, *files, "up", "--detach", "--wait"] in calls  # healthy first, as Harbor
    assert not any(call[1] == "run" for call in calls)  # no lone container: the project's main service
    assert ["docker", "exec", "--workdir", "/app"] == next(call for call in calls if call[1] == "exec")[:4]
    main = json.loads((engine.state / "override.json").read_text())
    assert main["networks"] == {"default": {"internal": True}}  # helpers reach one another, not the outside
    service = main["services"]["main"]
    assert service["container_name"] == name and service["image"].startswith("tslightning-task/helper-db:")
    assert service["pids_limit"] > 0 and service["cap_drop"] == ["NET_RAW"] and service["init"] is True
    interpolated = json.loads((engine.state / "compose_env.json").read_text())
    assert interpolated == {"CPUS": "1", "MEMORY": "2048M", "CONTEXT_DIR": str(task.environment_dir.resolve())}
    down = ["docker", "compose", *project, *files, "down", "--volumes", "--remove-orphans"]
    assert calls[-1][: len(down)] == down


def test_a_helper_that_calls_a_model_api_is_refused_with_an_engine_too(engine):
    task = TerminalTask.load(COOKBOOK / "simulated-user")
    status, reasons = unmet_needs(task, "docker")
    assert status == "needs model API" and "services.user-server.environment: ANTHROPIC_API_KEY" in reasons[0]


def test_a_real_engine_runs_a_compose_task():
    """The same cookbook task with a working engine's own compose (skipped where none answers, as here)."""
    cli = shutil.which("docker")
    probe = subprocess.run([cli, "info"], capture_output=True, text=True, timeout=60) if cli else None
    if probe is None or probe.returncode != 0:
        why = "no docker CLI" if probe is None else " ".join((probe.stderr or probe.stdout).strip().splitlines()[-1:])
        pytest.skip(f"no container engine answers `docker info` here: {why}")
    result = validate_task(COOKBOOK / "multi-container", containers="docker")
    assert result.status == "valid", result.problems


def test_helper_containers_are_refused_where_compose_is_missing(engine, monkeypatch):
    monkeypatch.setenv("FAKE_NO_COMPOSE", "1")
    task = TerminalTask.load(FIXTURES / "helper-db")
    status, reasons = unmet_needs(task, "podman")
    assert status == "needs helper container" and "`compose` is not available with the podman backend" in reasons[-1]
    with TerminalTaskAttempt(task, make_attempt_sandbox=sandbox_factory("podman"), toolchain=None) as attempt:
        with pytest.raises(SandboxUnavailableError, match="`.*podman compose` is not available"):
            attempt.run_command("true")
