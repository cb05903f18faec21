"""What a task's environment needs: the host stands in, a build, an image, network at build, helper containers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tslightning.tasks import validation
from tslightning.tasks.environment.stand_in_stages import stand_in_package
from tslightning.tasks.harbor.environment_needs import base_of, environment_needs
from tslightning.tasks.terminal_task import TaskFormatError, TerminalTask
from tslightning.tasks.validation import library_dir, unmet_needs


def _environment(tmp_path: Path, dockerfile: str | None, **files: str) -> Path:
    """``environment/`` with the Dockerfile and files (in a name, ``__`` is ``/`` and the last ``_`` a ``.``)."""
    environment = tmp_path / "environment"
    environment.mkdir(parents=True)
    if dockerfile is not None:
        (environment / "Dockerfile").write_text(dockerfile)
    for name, text in files.items():
        stem, _, suffix = name.replace("__", "/").replace("_", "-").rpartition("-")
        path = environment / f"{stem}.{suffix}" if stem else environment / suffix
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return environment


def test_every_shipped_task_runs_on_the_host():
    for task_dir in sorted(p for p in library_dir().iterdir() if (p / "task.toml").is_file()):
        needs = environment_needs(task_dir / "environment")
        assert needs.status == "host", (task_dir.name, needs.reasons)
        assert needs.workdir == "/app" and needs.start_command is None


def test_copies_into_app_and_env_keep_the_host(tmp_path):
    text = (
        "FROM python:3.13-slim-bookworm\nWORKDIR /app\nENV MODE=fast LEVEL=3\nCOPY data/ /app/data/\n"
        'COPY input.txt .\nCMD ["bash"]\n'
    )
    needs = environment_needs(_environment(tmp_path, text, input_txt="x", data__a_txt="y"))
    assert needs.status == "host" and needs.reasons == ()
    assert needs.env == {"MODE": "fast", "LEVEL": "3"}


@pytest.mark.parametrize(
    ("dockerfile", "reason"),
    [
        ("FROM ubuntu:24.04\nRUN apt-get update && apt-get install -y jq\n", "Dockerfile:2: RUN apt-get update"),
        ("FROM debian:bookworm\nWORKDIR /srv/app\n", "Dockerfile:2: WORKDIR /srv/app"),
        ("FROM python:3.12\nWORKDIR /app\nCOPY config.ini /etc/app/config.ini\n", "Dockerfile:3: COPY config.ini"),
        ("FROM python:3.12\nWORKDIR /app\nCOPY input.txt /app/in/input.txt\n", "(not /app/input.txt)"),
        ("FROM python:3.12\nCMD python3 -m http.server 8000\n", "start-up command 'python3 -m http.server 8000'"),
    ],
)
def test_what_needs_a_build(tmp_path, dockerfile, reason):
    needs = environment_needs(_environment(tmp_path, dockerfile, input_txt="x", config_ini="y"))
    assert needs.status == "build" and any(reason in r for r in needs.reasons), needs.reasons


@pytest.mark.parametrize(
    ("dockerfile", "status", "reason"),
    [
        ("FROM node:20\n", "needs image", "Dockerfile:1: FROM node:20 (no Debian root stands in for it)"),
        ("FROM golang:1.22 AS b\nFROM debian\nCOPY --from=b /x /x\n", "needs image", "multi-stage build (2 FROM"),
        ("FROM debian\nRUN curl -L https://github.com/x/y/releases/z.tgz | tar xz\n", "needs network at build",
         "Dockerfile:2: fetches from github.com"),
        ("FROM python:3.12\nRUN npm install -g left-pad\n", "needs network at build", "npm installs from registry"),
        ("FROM debian\nADD https://example.com/data.csv /app/\n", "needs network at build", "from example.com"),
    ],
)  # fmt: skip
def test_what_cannot_be_built_here(tmp_path, dockerfile, status, reason):
    needs = environment_needs(_environment(tmp_path, dockerfile))
    assert needs.status == status and any(reason in r for r in needs.reasons), needs.reasons


def test_registries_are_reachable_at_build(tmp_path):
    text = (
        "FROM python:3.12\nRUN pip install --index-url https://pypi.org/simple numpy==2.1.0\n"
        "RUN curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh\n"
    )
    needs = environment_needs(_environment(tmp_path, text))
    assert needs.status == "build" and needs.network_hosts == ()


def test_image_without_dockerfile_and_helper_containers(tmp_path):
    assert environment_needs(_environment(tmp_path / "a", None), docker_image="ghcr.io/x/y:1").status == "needs image"
    assert environment_needs(_environment(tmp_path / "b", None)).status == "host"
    compose = "services:\n  main:\n    build: .\n  db:\n    image: postgres:16\n"
    needs = environment_needs(_environment(tmp_path / "c", "FROM debian\n", docker_compose_yaml=compose))
    assert needs.status == "needs image"
    assert needs.reasons == ("docker-compose.yaml: services.db.image postgres:16 (no Debian root stands in for it)",)
    separate = environment_needs(_environment(tmp_path / "d", "FROM debian\n"), verifier_mode="separate")
    assert separate.status == "needs helper container"


def test_base_images_the_builder_maps():
    assert base_of("python:3.13-slim-bookworm") == ("python", "3.13-slim-bookworm")
    assert base_of("docker.io/library/ubuntu") == ("ubuntu", "latest")
    assert base_of("debian@sha256:abc") == ("debian", "latest")
    assert base_of("public.ecr.aws/docker/library/debian:bookworm-slim@sha256:4724b8cc") == ("debian", "bookworm-slim")
    assert base_of("mirror.gcr.io/library/python:3.12-slim") == ("python", "3.12-slim")
    assert base_of("public.ecr.aws/docker/library/node:20-slim") is None  # mirrored, but not a base we map
    assert base_of("public.ecr.aws/someone/debian:12") is None  # not the official image
    assert base_of("alpine:3.20") is None and base_of("ghcr.io/laude-institute/t-bench/python:3.13") is None


def _task(tmp_path: Path, dockerfile: str, toml: str = "") -> Path:
    root = tmp_path / "task"
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
    (root / "instruction.md").write_text("Do it.\n")
    (root / "task.toml").write_text(toml)
    _environment(root, dockerfile)
    return root


def test_tasks_carry_their_needs_and_image_env(tmp_path, monkeypatch):
    monkeypatch.setattr(validation, "builder_problem", lambda: "image-lite builds need mmdebstrap")
    toml = '[environment]\nenv = { LEVEL = "9" }\n'
    task = TerminalTask.load(_task(tmp_path, "FROM debian\nWORKDIR /app\nENV LEVEL=1 NAME=x\n", toml))
    assert task.command_env == {"LEVEL": "9", "NAME": "x"} and task.workdir == "/app" and unmet_needs(task) is None
    moved = TerminalTask.load(_task(tmp_path / "w", "FROM debian\n", '[environment]\nworkdir = "/srv"\n'))
    status, reasons = unmet_needs(moved)
    assert status == "needs image" and "[environment] workdir /srv" in reasons[0]
    assert "and image-lite builds need mmdebstrap" in reasons[0]
    monkeypatch.setattr(validation, "builder_problem", lambda: None)
    assert unmet_needs(moved) is None  # built as image-lite where the builder runs


def test_an_unreadable_dockerfile_names_its_line(tmp_path):
    with pytest.raises(TaskFormatError) as caught:
        TerminalTask.load(_task(tmp_path, "FROM debian\nWHAT? now\n"))
    assert caught.value.problems == ["environment/Dockerfile: line 2: 'WHAT?' is not a Dockerfile instruction"]


def test_harbor_main_service_is_the_tasks_own_even_without_a_build(tmp_path):
    # Harbor's base file gives `main` its build; a task's compose file often only adds a built helper to it.
    compose = "services:\n  main:\n    depends_on: [ledger]\n  ledger:\n    build:\n      context: ./ledger\n"
    environment = _environment(tmp_path / "a", "FROM debian\n", docker_compose_yaml=compose)
    assert environment_needs(environment).status == "needs helper container"  # no ledger/Dockerfile
    (environment / "ledger").mkdir()
    (environment / "ledger" / "Dockerfile").write_text("FROM python:3.12-slim\nRUN pip install flask\n")
    needs = environment_needs(environment)
    assert needs.status == "build" and [service.name for service in needs.helpers] == ["ledger"]
    assert (
        needs.reasons[0]
        == "docker-compose.yaml: helper services ledger (each built as its image, beside the task's own)"
    )
    alone = "services:\n  main:\n    environment: [MODE=test]\n"
    only_main = environment_needs(_environment(tmp_path / "b", "FROM debian\n", docker_compose_yaml=alone))
    assert only_main.status == "host" and only_main.env == {"MODE": "test"}  # main's own environment, no helper
    built = "services:\n  client:\n    build: .\n"  # Terminal-Bench 1's one service builds the task's own image
    assert environment_needs(_environment(tmp_path / "c", "FROM debian\n", docker_compose_yaml=built)).status == "host"


def test_astral_uv_image_stands_in_from_its_wheel_any_other_stage_needs_its_image(tmp_path):
    uv = "FROM python:3.12-slim\nCOPY --from=ghcr.io/astral-sh/uv:latest /uv /uvx /bin/\n"
    needs = environment_needs(_environment(tmp_path / "a", uv))
    assert needs.status == "build"
    assert "Dockerfile:2: COPY --from=ghcr.io/astral-sh/uv:latest (its binaries, from the uv wheel)" in needs.reasons
    other = environment_needs(_environment(tmp_path / "b", "FROM python:3.12\nCOPY --from=node:20 /usr/bin/node /x\n"))
    assert other.status == "needs image" and "COPY --from=node:20 (a file from another image)" in other.reasons[0]
    assert stand_in_package("ghcr.io/astral-sh/uv:0.9.7@sha256:ab") == "uv" and stand_in_package("uv") is None
