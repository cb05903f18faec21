"""What a task's environment needs before an attempt can run in it, read from its files without building anything.

Harbor builds every task's ``environment/Dockerfile`` (or pulls ``[environment] docker_image``). Here there may be
no container engine and no image registry, so each task is classified by what its environment asks for:

``host``
    The host's system stands in for the image: the Dockerfile starts from a Debian / Ubuntu / Python base, works
    in ``/app`` and only copies the task's files there (``ENV`` is honoured as the commands' environment). This is
    the shipped library's shape; nothing is built.
``build``
    The Dockerfile must be built (``RUN`` steps, files copied outside ``/app``, another ``WORKDIR``, a start-up
    ``CMD`` / ``ENTRYPOINT``) from a base the builder maps to a Debian root (:data:`MAPPED_BASES`), with the
    network only to the package registries.
``needs image``
    Only the image itself will do: ``docker_image`` without a Dockerfile, a base image no Debian root stands in
    for, a multi-stage build, or ``COPY --from``.
``needs network at build``
    The build fetches from hosts other than the package registries (``curl`` / ``wget`` / ``git clone`` of other
    sites, language registries other than PyPI): each host is named.
``needs helper container``
    A compose file asking for what no sandbox here gives a service (``privileged``, host networking, volumes outside
    the task: each compose key named; :mod:`~tslightning.tasks.harbor.compose_project`), or a verifier in a container of
    its own (``[verifier] environment_mode = "separate"``).
``needs model API``
    A helper service that calls a model API outside this machine (its key in the service's environment): attempts
    run offline.

A compose file's helper services (besides Harbor's ``main``) are built like the task's own image, each from its
``build`` context or its ``image`` (a base a Debian root stands in for), so a task with helpers needs a build, and
whatever a helper's Dockerfile needs (``needs image``, ``needs network at build``) is the task's, named by service.

Every reason names the file and line (or key) it comes from, so ``tslightning tasks validate`` can say why a task
cannot run here instead of reporting that its reference solution scored 0.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from tslightning.tasks.harbor.compose_project import ComposeError, ComposeProject, ServiceSpec, read_compose
from tslightning.tasks.harbor.dockerfile import Dockerfile, DockerfileError, Instruction, env_pairs

STAND_IN_STAGES = {"ghcr.io/astral-sh/uv": "uv"}
"""Image name → the PyPI package that ships its files."""


def stand_in_package(image: str) -> str | None:
    """The PyPI package shipping ``image``'s files (:data:`STAND_IN_STAGES`), else ``None``."""
    name = image.split("@", 1)[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]
    return STAND_IN_STAGES.get(name)


EnvironmentStatus = Literal[
    "host", "build", "needs image", "needs network at build", "needs helper container", "needs model API"
]

MAPPED_BASES = ("python", "debian", "ubuntu", "buildpack-deps")
"""Base images (Docker Hub's official names, any tag) whose environment a Debian root with Python stands in for."""
OFFICIAL_IMAGE_MIRRORS = (
    "docker.io/", "index.docker.io/", "registry-1.docker.io/", "registry.hub.docker.com/",
    "public.ecr.aws/docker/", "mirror.gcr.io/",
)  # fmt: skip
"""Registry prefixes under which Docker Hub's official images (``library/<name>``) are published as they are: many
published tasks pin ``public.ecr.aws/docker/library/debian:bookworm-slim@sha256:...`` to avoid Docker Hub's limits."""
TERMINAL_BENCH_1_BASES = {
    "ghcr.io/laude-institute/t-bench/python-3-13": ("python", "3.13"),
    "ghcr.io/laude-institute/t-bench/ubuntu-24-04": ("ubuntu", "24.04"),
}
"""Terminal-Bench 1's own base images (most of its tasks start from one), mapped as the images they extend."""
REGISTRY_HOSTS = (
    "deb.debian.org", "security.debian.org", "archive.ubuntu.com", "security.ubuntu.com", "ports.ubuntu.com",
    "pypi.org", "files.pythonhosted.org", "pypi.python.org", "astral.sh",
)  # fmt: skip
"""Hosts a build may reach: the package registries (the offline toolchain serves astral.sh's uv installer)."""
UNREACHABLE_TOOLS = {
    "npm": "registry.npmjs.org",
    "yarn": "registry.yarnpkg.com",
    "pnpm": "registry.npmjs.org",
    "cargo": "crates.io",
    "go": "proxy.golang.org",
    "gem": "rubygems.org",
    "conda": "conda.anaconda.org",
    "mamba": "conda.anaconda.org",
    "rustup": "static.rust-lang.org",
}
"""Package tools whose registries are not package mirrors reachable here, with the host each fetches from."""
PLACEHOLDER_COMMANDS = frozenset(
    {"bash", "/bin/bash", "sh", "/bin/sh", "sleep infinity", "tail -f /dev/null", "bash -l", "/bin/bash -l"}
)
"""``CMD`` values that only keep a container alive: no start-up service to run."""
APP = "/app"
COMPOSE_FILES = ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml")
HARBOR_MAIN_SERVICE = "main"
"""The compose service Harbor runs the task's own environment in; every other service is a helper container."""

_URL = re.compile(r"\b(?:https?|ftp|git)://([A-Za-z0-9.-]+)")
_SSH_GIT = re.compile(r"\bgit@([A-Za-z0-9.-]+):")
_IGNORED = frozenset({"ARG", "LABEL", "EXPOSE", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "VOLUME"})
_ORDER: tuple[EnvironmentStatus, ...] = (
    "needs model API", "needs helper container", "needs image", "needs network at build", "build", "host",
)  # fmt: skip


@dataclass(frozen=True)
class EnvironmentNeeds:
    """What one task's environment needs (see the module docstring).

    Attributes:
        status: The most demanding need found.
        reasons: Why, one line each naming the file and line or key (empty for ``host``).
        dockerfile: The parsed Dockerfile, if the task has one.
        env: The image's ``ENV`` (applied to every command, under ``[environment] env``).
        workdir: The image's last ``WORKDIR`` (``None``: not set).
        start_command: The image's start-up command (``ENTRYPOINT`` + ``CMD``), ``None`` for none or a placeholder.
        network_hosts: Hosts outside the package registries the build fetches from.
        compose: The task's compose file, when it has one (its helper services and ``main``'s overrides).
    """

    status: EnvironmentStatus
    reasons: tuple[str, ...] = ()
    dockerfile: Dockerfile | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    start_command: str | None = None
    network_hosts: tuple[str, ...] = ()
    compose: ComposeProject | None = None

    @property
    def helpers(self) -> list[ServiceSpec]:
        """The compose file's helper services, in start order (none without a compose file)."""
        return self.compose.helpers if self.compose is not None else []

    @property
    def summary(self) -> str:
        """One line: the status and its reasons."""
        return self.status if not self.reasons else f"{self.status}: {'; '.join(self.reasons)}"


class _Findings:
    """Reasons gathered per status while reading a task's files."""

    def __init__(self) -> None:
        self.by_status: dict[EnvironmentStatus, list[str]] = {status: [] for status in _ORDER}
        self.hosts: list[str] = []

    def add(self, status: EnvironmentStatus, reason: str) -> None:
        self.by_status[status].append(reason)

    def status(self) -> EnvironmentStatus:
        return next(status for status in _ORDER if status == "host" or self.by_status[status])


def environment_needs(
    environment_dir: Path,
    docker_image: str | None = None,
    verifier_mode: str | None = None,
    variables: Mapping[str, str] | None = None,
) -> EnvironmentNeeds:
    """Classify the environment of the task whose ``environment/`` is ``environment_dir``.

    Args:
        environment_dir: The task's ``environment/`` (its Dockerfile, compose file and build context).
        docker_image: ``[environment] docker_image``.
        verifier_mode: ``[verifier] environment_mode``.
        variables: What the compose file's ``${VAR}`` values name (``[environment] env``, Harbor's variables).

    Raises:
        DockerfileError: a Dockerfile cannot be read (the message names the line).
        ComposeError: the compose file cannot be read (the message names the key).
    """
    findings = _Findings()
    compose = _check_compose(environment_dir, variables or {}, findings)
    if verifier_mode == "separate":
        findings.add("needs helper container", "task.toml: [verifier] runs in a container of its own (separate)")
    path = environment_dir / "Dockerfile"
    if not path.is_file():
        if docker_image:
            findings.add("needs image", f"task.toml: [environment] docker_image {docker_image!r} and no Dockerfile")
        return _needs(findings, compose=compose)
    dockerfile = Dockerfile.read(path)
    env, workdir, start = _read_image(dockerfile, environment_dir, findings)
    if compose is not None:
        env.update(compose.main.environment)  # the container's environment: every command of main sees it
    return _needs(findings, dockerfile, env, workdir, start, compose)


def _needs(findings: _Findings, dockerfile=None, env=None, workdir=None, start=None, compose=None) -> EnvironmentNeeds:
    status = findings.status()
    reasons = tuple(reason for s in _ORDER[: _ORDER.index(status) + 1] for reason in findings.by_status[s])
    hosts = tuple(dict.fromkeys(findings.hosts))
    return EnvironmentNeeds(status, reasons, dockerfile, env or {}, workdir, start, hosts, compose)


def base_of(image: str) -> tuple[str, str] | None:
    """``(name, tag)`` of ``image`` when it is one of :data:`MAPPED_BASES` (Docker Hub's ``library/`` names, also
    through the registries that mirror them, :data:`OFFICIAL_IMAGE_MIRRORS`; digests allowed), else ``None``."""
    reference = image.split("@", 1)[0]
    for prefix in OFFICIAL_IMAGE_MIRRORS:
        reference = reference.removeprefix(prefix)
    reference = reference.removeprefix("library/")
    name, _, tag = reference.partition(":")
    if name in TERMINAL_BENCH_1_BASES:
        name, version = TERMINAL_BENCH_1_BASES[name]
        return name, f"{version}-{tag or 'latest'}"
    return (name, tag or "latest") if name in MAPPED_BASES else None


def _read_image(dockerfile: Dockerfile, context: Path, findings: _Findings, where: str | None = None):
    """Walk the instructions: base, files, working directory, environment, build steps, start-up command
    (``where`` names the Dockerfile in reasons: default its file name)."""
    where = where or dockerfile.path.name
    if dockerfile.stages > 1:
        findings.add("needs image", f"{where}: a multi-stage build ({dockerfile.stages} FROM lines)")
    if base_of(dockerfile.base_image) is None:
        line = dockerfile.of("FROM")[-1].line
        findings.add("needs image", f"{where}:{line}: FROM {dockerfile.base_image} (no Debian root stands in for it)")
    env: dict[str, str] = {}
    workdir: str | None = None
    entrypoint: Instruction | None = None
    command: Instruction | None = None
    for instruction in dockerfile.instructions:
        at = f"{where}:{instruction.line}"
        keyword = instruction.keyword
        if keyword == "WORKDIR":
            workdir = _absolute(instruction.arguments, workdir)
            if workdir != APP:
                findings.add("build", f"{at}: WORKDIR {workdir} (the host shows only {APP})")
        elif keyword == "ENV":
            env.update(env_pairs(instruction))
        elif keyword in ("COPY", "ADD"):
            _check_copy(instruction, at, workdir, context, findings)
        elif keyword == "RUN":
            findings.add("build", f"{at}: RUN {_short(instruction.shell_command)}")
            _check_network(instruction.shell_command + "".join(instruction.heredocs), at, findings)
        elif keyword == "USER" and instruction.arguments not in ("root", "0"):
            findings.add("build", f"{at}: USER {instruction.arguments}")
        elif keyword == "ENTRYPOINT":
            entrypoint = instruction
        elif keyword == "CMD":
            command = instruction
    start = _start_command(entrypoint, command)
    if start is not None:
        findings.add("build", f"{where}: start-up command {_short(start)!r} (a service the environment runs)")
    return env, workdir, start


def _check_copy(instruction: Instruction, at: str, workdir: str | None, context: Path, findings: _Findings) -> None:
    words = instruction.words()
    if "from" in instruction.flags:
        stage = instruction.flags["from"]
        if stand_in_package(stage) is not None:
            findings.add("build", f"{at}: COPY --from={stage} (its binaries, from the {stand_in_package(stage)} wheel)")
        else:
            findings.add("needs image", f"{at}: COPY --from={stage} (a file from another image)")
        return
    if len(words) < 2 and not instruction.heredocs:
        findings.add("build", f"{at}: {instruction.keyword} needs a source and a destination")
        return
    sources, destination = words[:-1], _absolute(words[-1], workdir, keep_slash=True)
    for source in sources:
        host = _URL.match(source)
        if host and host.group(1) not in REGISTRY_HOSTS:
            findings.hosts.append(host.group(1))
            findings.add("needs network at build", f"{at}: ADD {source} (from {host.group(1)})")
            return
    if instruction.heredocs or any(_URL.match(s) for s in sources):
        findings.add("build", f"{at}: {instruction.keyword} of generated content to {destination}")
        return
    for source in sources:
        if not _copies_to_same_place(source, destination, context):
            findings.add("build", f"{at}: {instruction.keyword} {source} {destination} (not {APP}/{source})")
            return


def _copies_to_same_place(source: str, destination: str, context: Path) -> bool:
    """Whether ``COPY source destination`` puts the file where seeding ``/app`` with the context puts it."""
    relative = source.strip("/").removeprefix("./")
    if relative in ("", "."):
        return destination.rstrip("/") == APP
    name = relative.rstrip("/")
    if (context / name).is_dir():
        return destination.rstrip("/") == f"{APP}/{name}" or (relative.endswith("/") and destination == f"{APP}/")
    return destination in (f"{APP}/{name}", f"{APP}/") or (destination == APP and "/" not in name)


def _check_network(text: str, at: str, findings: _Findings) -> None:
    hosts = [match.group(1) for pattern in (_URL, _SSH_GIT) for match in pattern.finditer(text)]
    for host in dict.fromkeys(hosts):
        if host not in REGISTRY_HOSTS and not host.endswith((".debian.org", ".ubuntu.com", ".pythonhosted.org")):
            findings.hosts.append(host)
            findings.add("needs network at build", f"{at}: fetches from {host}")
    for tool, registry in UNREACHABLE_TOOLS.items():
        if re.search(rf"(?:^|[\s;&|(]){re.escape(tool)}\s+(?:install|add|get|i|ci|create)\b", text):
            findings.hosts.append(registry)
            findings.add("needs network at build", f"{at}: {tool} installs from {registry}")


def _check_compose(environment_dir: Path, variables: Mapping[str, str], findings: _Findings) -> ComposeProject | None:
    """Read the compose file, if any: what it refuses, and what each helper service's image needs."""
    path = next((environment_dir / name for name in COMPOSE_FILES if (environment_dir / name).is_file()), None)
    if path is None:
        return None
    project = read_compose(path, variables, own_service(path))
    for reason in project.model_apis:
        findings.add("needs model API", reason)
    for reason in project.refusals:
        findings.add("needs helper container", reason)
    helpers = project.helpers
    if helpers:
        names = ", ".join(service.name for service in helpers)
        findings.add("build", f"{path.name}: helper services {names} (each built as its image, beside the task's own)")
    for service in helpers:
        _check_service(service, environment_dir, findings, path.name)
    return project


def _check_service(service: ServiceSpec, environment_dir: Path, findings: _Findings, compose_name: str) -> None:
    """What one helper's image needs (its Dockerfile read as the task's own is), each reason naming the service."""
    where = f"{compose_name}: services.{service.name}"
    if service.dockerfile is None:
        if service.image is None:
            findings.add("needs helper container", f"{where}: neither build nor image")
        elif base_of(service.image) is None:
            findings.add("needs image", f"{where}.image {service.image} (no Debian root stands in for it)")
        return
    if not service.dockerfile.is_file():
        findings.add("needs helper container", f"{where}.build: no Dockerfile at {service.dockerfile.name}")
        return
    dockerfile = Dockerfile.read(service.dockerfile)
    label = f"{service.name}: {service.dockerfile.relative_to(environment_dir.resolve())}"
    helper = _Findings()
    _read_image(dockerfile, service.dockerfile.parent, helper, label)
    for status in ("needs image", "needs network at build"):
        for reason in helper.by_status[status]:
            findings.add(status, reason)
    findings.hosts += helper.hosts


def own_service(path: Path) -> str:
    """The task's own service of a compose file: Harbor's ``main`` (its build, image and command come from Harbor's
    base file, so the task's file often overrides only ``depends_on``), else the one that builds (Terminal-Bench 1's
    one service), else ``main``."""
    try:
        services = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("services") or {}
    except (yaml.YAMLError, AttributeError, UnicodeDecodeError):
        return HARBOR_MAIN_SERVICE  # read_compose says what is wrong
    if not isinstance(services, dict) or HARBOR_MAIN_SERVICE in services:
        return HARBOR_MAIN_SERVICE
    builds = (name for name, spec in services.items() if isinstance(spec, dict) and "build" in spec)
    return str(next(builds, HARBOR_MAIN_SERVICE))


def _start_command(entrypoint: Instruction | None, command: Instruction | None) -> str | None:
    parts = [i.shell_command for i in (entrypoint, command) if i is not None and i.shell_command.strip()]
    text = " ".join(parts).strip()
    return None if not text or text in PLACEHOLDER_COMMANDS else text


def _absolute(path: str, workdir: str | None, keep_slash: bool = False) -> str:
    """``path`` resolved against ``workdir`` (Docker's default ``/``), normalised."""
    if not path.startswith("/"):
        path = f"{(workdir or '/').rstrip('/')}/{path}"
    trailing = keep_slash and path.endswith("/") and path != "/"
    parts: list[str] = []
    for part in path.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            parts = parts[:-1]
        else:
            parts.append(part)
    return "/" + "/".join(parts) + ("/" if trailing else "")


def _short(text: str, limit: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = [
    "ComposeError",
    "DockerfileError",
    "EnvironmentNeeds",
    "EnvironmentStatus",
    "base_of",
    "environment_needs",
    "own_service",
]
