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
    A compose file with services besides the task's own, or a verifier in a container of its own
    (``[verifier] environment_mode = "separate"``).

Every reason names the file and line (or key) it comes from, so ``tslightning tasks validate`` can say why a task
cannot run here instead of reporting that its reference solution scored 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from tslightning.tasks.dockerfile import Dockerfile, DockerfileError, Instruction, env_pairs

EnvironmentStatus = Literal["host", "build", "needs image", "needs network at build", "needs helper container"]

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
HARBOR_MAIN_SERVICE = "main"
"""The compose service Harbor runs the task's own environment in; every other service is a helper container."""

_URL = re.compile(r"\b(?:https?|ftp|git)://([A-Za-z0-9.-]+)")
_SSH_GIT = re.compile(r"\bgit@([A-Za-z0-9.-]+):")
_IGNORED = frozenset({"ARG", "LABEL", "EXPOSE", "MAINTAINER", "STOPSIGNAL", "HEALTHCHECK", "SHELL", "VOLUME"})
_ORDER: tuple[EnvironmentStatus, ...] = (
    "needs helper container", "needs image", "needs network at build", "build", "host",
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
    """

    status: EnvironmentStatus
    reasons: tuple[str, ...] = ()
    dockerfile: Dockerfile | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    start_command: str | None = None
    network_hosts: tuple[str, ...] = ()

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
) -> EnvironmentNeeds:
    """Classify the environment of the task whose ``environment/`` is ``environment_dir``.

    Args:
        environment_dir: The task's ``environment/`` (its Dockerfile, compose file and build context).
        docker_image: ``[environment] docker_image``.
        verifier_mode: ``[verifier] environment_mode``.

    Raises:
        DockerfileError: the Dockerfile cannot be read (the message names the line).
    """
    findings = _Findings()
    _check_compose(environment_dir, findings)
    if verifier_mode == "separate":
        findings.add("needs helper container", "task.toml: [verifier] runs in a container of its own (separate)")
    path = environment_dir / "Dockerfile"
    if not path.is_file():
        if docker_image:
            findings.add("needs image", f"task.toml: [environment] docker_image {docker_image!r} and no Dockerfile")
        return _needs(findings)
    dockerfile = Dockerfile.read(path)
    env, workdir, start = _read_image(dockerfile, environment_dir, findings)
    return _needs(findings, dockerfile, env, workdir, start)


def _needs(findings: _Findings, dockerfile=None, env=None, workdir=None, start=None) -> EnvironmentNeeds:
    status = findings.status()
    reasons = tuple(reason for s in _ORDER[: _ORDER.index(status) + 1] for reason in findings.by_status[s])
    return EnvironmentNeeds(
        status, reasons, dockerfile, env or {}, workdir, start, tuple(dict.fromkeys(findings.hosts))
    )


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


def _read_image(dockerfile: Dockerfile, context: Path, findings: _Findings):
    """Walk the instructions: base, files, working directory, environment, build steps, start-up command."""
    where = dockerfile.path.name
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
        findings.add("needs image", f"{at}: COPY --from={instruction.flags['from']} (a file from another image)")
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


def _check_compose(environment_dir: Path, findings: _Findings) -> None:
    for name in ("docker-compose.yaml", "docker-compose.yml", "compose.yaml", "compose.yml"):
        path = environment_dir / name
        if not path.is_file():
            continue
        try:
            services = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("services") or {}
        except (yaml.YAMLError, AttributeError, UnicodeDecodeError) as error:
            findings.add("needs helper container", f"{name}: unreadable compose file ({type(error).__name__})")
            return
        helpers = sorted(service for service in services if service != _own_service(services))
        if helpers:
            findings.add("needs helper container", f"{name}: services besides the task's own ({', '.join(helpers)})")
        return


def _own_service(services: dict) -> str | None:
    """The task's own service of a compose file: Harbor's ``main`` (its build, image and command come from Harbor's
    base file, so the task's file often overrides only ``depends_on``), else the one that builds, else none."""
    if HARBOR_MAIN_SERVICE in services:
        return HARBOR_MAIN_SERVICE
    return next((name for name, spec in services.items() if isinstance(spec, dict) and "build" in spec), None)


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


__all__ = ["DockerfileError", "EnvironmentNeeds", "EnvironmentStatus", "base_of", "environment_needs"]
