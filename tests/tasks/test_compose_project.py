"""A task's compose file read as Harbor's docker compose reads it: services, interpolation, depends_on, healthchecks,
and one line naming the compose key for what cannot be honoured here (no builds: these only read files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tslightning.tasks.harbor.compose_project import ComposeError, ServiceSpec, read_compose
from tslightning.tasks.harbor.environment_needs import environment_needs
from tslightning.tasks.terminal_task import TerminalTask

COOKBOOK = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_cookbook"


def _compose(tmp_path: Path, text: str, **files: str) -> Path:
    (tmp_path / "Dockerfile").write_text("FROM python:3.12-slim\n")
    for name, content in files.items():
        path = tmp_path / name.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    (tmp_path / "docker-compose.yaml").write_text(text)
    return tmp_path / "docker-compose.yaml"


def test_the_cookbook_helpers_read_as_docker_compose_reads_them():
    task = TerminalTask.load(COOKBOOK / "multi-container")
    (api,) = task.needs.helpers
    assert task.needs.status == "build" and api.name == "api-server" and api.expose == (5000,)
    assert api.dockerfile == (COOKBOOK / "multi-container" / "environment" / "api-server" / "Dockerfile").resolve()
    assert task.needs.compose.main.depends_on == {"api-server": "service_healthy"}
    check = api.healthcheck
    assert (check.interval_s, check.timeout_s, check.retries, check.start_period_s) == (2.0, 5.0, 15, 5.0)
    assert check.command.startswith("python3 -c 'import socket;")  # CMD: the arguments quoted, no shell added
    assert task.needs.compose.host_names() == ["main", "api-server"]


def test_values_are_interpolated_from_the_task_not_the_trainer(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINER_SECRET", "leaked")
    path = _compose(
        tmp_path,
        "services:\n  api:\n    image: python:3.12\n    environment:\n"
        "      - LEVEL=${LEVEL:-3}\n      - MODE=${MODE}\n      - SECRET=${TRAINER_SECRET}\n"
        "      - PRICE=$$5\n      - EMPTY=${UNSET-}\n      - SET=${MODE:+yes}\n"
        "    command: python -m http.server ${PORT:-8000}\n    working_dir: /srv\n",
    )
    project = read_compose(path, {"MODE": "fast"})
    api = project.services["api"]
    assert api.environment == {"LEVEL": "3", "MODE": "fast", "SECRET": "", "PRICE": "$5", "EMPTY": "", "SET": "yes"}
    assert api.command == ("python", "-m", "http.server", "8000") and api.working_dir == "/srv"
    with pytest.raises(ComposeError, match=r"services.api.image: variable TAG is required \(pin it\)"):
        read_compose(_compose(tmp_path, "services:\n  api:\n    image: python:${TAG:?pin it}\n"), {})


def test_what_cannot_be_honoured_is_refused_one_line_naming_the_key(tmp_path):
    path = _compose(
        tmp_path,
        "services:\n  main:\n    command: python3 serve.py\n"
        "  db:\n    image: python:3.12\n    privileged: true\n    network_mode: host\n"
        "    volumes: [/var/run/docker.sock:/var/run/docker.sock, ../secrets:/s, cache:/cache, ./data:/data:ro]\n"
        "    devices: [/dev/kvm]\n    restart: always\n    labels: {a: b}\n"
        "volumes:\n  cache: {}\nsecrets:\n  token: {file: t.txt}\n",
        data__seed="1\n",
    )
    project = read_compose(path, {})
    assert project.refusals == (
        "docker-compose.yaml: secrets: not supported without a container engine",
        "docker-compose.yaml: services.main.command: the task's own service runs the agent's commands (Harbor's sleep)",
        "docker-compose.yaml: services.db.privileged: a privileged container (no sandbox here grants the host's "
        "devices and capabilities)",
        "docker-compose.yaml: services.db.network_mode: a network mode other than the attempt's own network (host "
        "networking, another container's)",
        "docker-compose.yaml: services.db.devices: host devices",
        "docker-compose.yaml: services.db.volumes: /var/run/docker.sock is outside the task's environment/",
        "docker-compose.yaml: services.db.volumes: ../secrets is outside the task's environment/",
    )  # restart and labels change nothing here: ignored
    volumes = project.services["db"].volumes
    assert [(v.named, v.target, v.read_only) for v in volumes] == [(True, "/cache", False), (False, "/data", True)]
    needs = environment_needs(tmp_path)
    assert needs.status == "needs helper container" and needs.reasons[0] == project.refusals[0]


def test_a_helper_that_calls_a_model_api_needs_it():
    task = TerminalTask.load(COOKBOOK / "simulated-user")
    assert task.needs.status == "needs model API"
    assert task.needs.reasons == (
        "docker-compose.yaml: services.user-server.environment: ANTHROPIC_API_KEY (the service calls a model API "
        "outside this machine, and attempts run offline)",
    )


def test_services_start_after_what_they_depend_on_and_cycles_are_refused(tmp_path):
    text = (
        "services:\n  main:\n    depends_on: [web]\n"
        "  web:\n    image: python:3.12\n    depends_on: {db: {condition: service_healthy}, seed: "
        "{condition: service_completed_successfully}}\n"
        "  seed:\n    image: python:3.12\n    depends_on: [db]\n"
        "  db:\n    image: python:3.12\n    healthcheck: {test: [CMD-SHELL, 'test -e /tmp/up'], interval: 1m30s}\n"
        "  extra:\n    image: python:3.12\n    profiles: [debug]\n"
    )
    project = read_compose(_compose(tmp_path, text), {})
    assert [service.name for service in project.helpers] == ["db", "seed", "web"]  # `extra` is in a profile
    assert project.services["db"].healthcheck.command == "test -e /tmp/up"
    assert project.services["db"].healthcheck.interval_s == 90.0
    cyclic = "services:\n  a:\n    image: python:3.12\n    depends_on: [b]\n  b:\n    image: python:3.12\n"
    with pytest.raises(ComposeError, match="a cycle"):
        read_compose(_compose(tmp_path, cyclic + "    depends_on: [a]\n"), {})
    with pytest.raises(ComposeError, match=r"services.a.depends_on names no service: \['ghost'\]"):
        read_compose(_compose(tmp_path, "services:\n  a:\n    image: python:3.12\n    depends_on: [ghost]\n"), {})


@pytest.mark.parametrize(
    ("entrypoint", "command", "image_entry", "image_cmd", "expected"),
    [
        (None, None, None, ("python", "server.py"), "python server.py"),
        (None, ("uv", "run", "s.py"), ("tini", "--"), ("python", "x.py"), "tini -- uv run s.py"),
        (("sh", "-c"), None, None, ("python", "x.py"), "sh -c"),  # an entrypoint drops the image's CMD
        (None, None, "serve --port 80", ("ignored",), "serve --port 80"),  # shell form: no CMD appended
        (None, None, None, "python3 app.py > /tmp/log", "python3 app.py > /tmp/log"),
    ],
)
def test_the_start_command_combines_entrypoint_and_command_as_docker_does(
    entrypoint, command, image_entry, image_cmd, expected
):
    service = ServiceSpec("s", entrypoint=entrypoint, command=command)
    assert service.start_command(image_entry, image_cmd) == expected
