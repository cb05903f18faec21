"""A task's ``environment/docker-compose.yaml``, read as Harbor's ``docker compose`` reads it, without an engine.

Harbor merges the task's compose file over its own ``main`` service (the task's Dockerfile, kept alive with ``sleep
infinity``): the file adds helper services (an API server, an MCP server, a database) and overrides for ``main``
(usually ``depends_on``). Here each service becomes a :class:`ServiceSpec`, with every value interpolated as compose
interpolates it (``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``, ``$$``) from the task's
``[environment] env`` and Harbor's own compose variables; a variable set nowhere is blank, as compose makes it (the
trainer's environment is not read: a task cannot pull the trainer's secrets into a helper).

What is honoured: ``build`` (a context inside ``environment/``, its ``dockerfile``), ``image`` (a base a Debian root
stands in for), ``command`` / ``entrypoint`` (list or string), ``environment`` (list or mapping), ``env_file``,
``working_dir``, ``expose`` and ``ports`` (the container's port: every service shares the attempt's network, so
nothing is published), ``healthcheck``, ``depends_on`` (list, or mapping with ``service_started``,
``service_healthy``, ``service_completed_successfully``), ``volumes`` (named volumes, and binds of paths inside
``environment/``: each attempt gets its own copy), ``extra_hosts``, ``hostname`` / ``container_name`` (more names for
the service), ``profiles`` (a service in a profile is not started, as without ``--profile``). Keys that change
nothing here are ignored (:data:`IGNORED_KEYS`: restart policies, labels, resource limits, which the task's own
limits replace). Anything else is refused, one line naming the compose key (:attr:`ComposeProject.refusals`):
``privileged``, ``devices``, ``cap_add``, host networking, volumes outside the task, ...

A helper that talks to an outside model API (a key such as ``ANTHROPIC_API_KEY`` in its environment) cannot work in
an offline attempt: :attr:`ComposeProject.model_apis` names it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tslightning.tasks.harbor.compose_fields import (
    CONDITIONS,
    ComposeError,
    Healthcheck,
    depends_on,
    extra_hosts,
    healthcheck,
    mapping,
    optional_str,
    words,
)

MAIN_SERVICE = "main"
"""Harbor's name for the task's own service (where the agent's commands run)."""
IGNORED_KEYS = frozenset(
    {
        "restart", "labels", "deploy", "mem_limit", "memswap_limit", "mem_reservation", "cpus", "cpu_shares",
        "cpu_count", "pids_limit", "ulimits", "shm_size", "stdin_open", "tty", "init", "platform", "pull_policy",
        "logging", "networks", "dns", "dns_search", "domainname", "stop_grace_period", "stop_signal", "oom_score_adj",
    }
)  # fmt: skip
"""Service keys that change nothing here: the task's own limits bound every service, every service shares one
network, and nothing is restarted."""
MODEL_API_VARIABLES = (
    "ANTHROPIC_API_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL", "GEMINI_API_KEY", "GOOGLE_API_KEY",
    "MISTRAL_API_KEY", "COHERE_API_KEY", "GROQ_API_KEY", "TOGETHER_API_KEY", "DEEPSEEK_API_KEY", "XAI_API_KEY",
    "OPENROUTER_API_KEY", "AZURE_OPENAI_API_KEY", "AWS_BEARER_TOKEN_BEDROCK", "HF_TOKEN",
)  # fmt: skip
"""Variables that hand a service the key (or address) of a model API outside this machine."""
HARBOR_VARIABLES = ("CONTEXT_DIR", "MAIN_IMAGE_NAME", "CPUS", "MEMORY")
"""Variables Harbor sets for its compose files (the task's file may name them)."""

_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
_SERVICE_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9._-]*\Z")


@dataclass(frozen=True)
class Volume:
    """One ``volumes`` entry: a named volume (``source`` is its name) or a bind of a path inside the task's
    ``environment/`` (``source`` is that host path), shown at ``target``."""

    source: str | Path
    target: str
    read_only: bool = False

    @property
    def named(self) -> bool:
        return isinstance(self.source, str)


@dataclass(frozen=True)
class ServiceSpec:
    """One service of the compose file (see the module docstring for what each field comes from).

    Attributes:
        name: The service's name (its host name in the attempt's network).
        dockerfile: The Dockerfile its image is built from (``build``), else ``None``.
        image: ``image`` (used when there is no ``build``).
        entrypoint: ``entrypoint`` as an argument list (a string is split as compose splits it), ``None``: the
            image's.
        command: ``command`` likewise, ``None``: the image's ``CMD``.
        environment: ``environment`` and ``env_file`` values, after the image's ``ENV``.
        working_dir: ``working_dir``, ``None``: the image's.
        expose: Container ports it serves (``expose``, ``ports``).
        healthcheck: Its ``healthcheck``, ``None`` for none (or ``disable``).
        depends_on: Service → condition to wait for before this one starts.
        volumes: Its ``volumes``.
        aliases: More host names (``hostname``, ``container_name``).
        extra_hosts: ``extra_hosts`` as ``(name, address)``.
    """

    name: str
    dockerfile: Path | None = None
    image: str | None = None
    entrypoint: tuple[str, ...] | None = None
    command: tuple[str, ...] | None = None
    environment: dict[str, str] = field(default_factory=dict)
    working_dir: str | None = None
    expose: tuple[int, ...] = ()
    healthcheck: Healthcheck | None = None
    depends_on: dict[str, str] = field(default_factory=dict)
    volumes: tuple[Volume, ...] = ()
    aliases: tuple[str, ...] = ()
    extra_hosts: tuple[tuple[str, str], ...] = ()

    def start_command(self, entrypoint: tuple[str, ...] | str | None, command: tuple[str, ...] | str | None) -> str:
        """The shell command the service starts with, given its image's ``ENTRYPOINT`` and ``CMD`` (exec form as a
        tuple, shell form as a string), combined as Docker combines them: ``entrypoint`` here replaces the image's
        and drops its ``CMD``; ``command`` here replaces the ``CMD``; a shell-form entrypoint ignores any ``CMD``."""
        entry = self.entrypoint if self.entrypoint is not None else entrypoint
        cmd = self.command if self.command is not None else (None if self.entrypoint is not None else command)
        if isinstance(entry, str):
            return entry
        words = [*(entry or ())]
        if isinstance(cmd, str):
            return shlex.join(words) + (" " if words else "") + (cmd if not words else shlex.quote(cmd))
        words += cmd or ()
        return shlex.join(words)


@dataclass(frozen=True)
class ComposeProject:
    """A task's compose file as read (see the module docstring).

    Attributes:
        path: The compose file.
        services: Every service that starts, by name (``main`` included when the file names it).
        named_volumes: Named volumes (each attempt gets its own, empty).
        refusals: What cannot be honoured here, one line each naming the compose key.
        model_apis: Helpers that need an outside model API, one line each naming the variable.
        own: The task's own service (Harbor's ``main``; Terminal-Bench 1's one service that builds).
    """

    path: Path
    services: dict[str, ServiceSpec]
    named_volumes: tuple[str, ...] = ()
    refusals: tuple[str, ...] = ()
    model_apis: tuple[str, ...] = ()
    own: str = MAIN_SERVICE

    @property
    def main(self) -> ServiceSpec:
        """The task's own service (its image is the task's Dockerfile; the agent's commands run in it)."""
        return self.services.get(self.own, ServiceSpec(self.own))

    @property
    def helpers(self) -> list[ServiceSpec]:
        """The services besides the task's own, in start order (each after what it depends on)."""
        order: list[str] = []
        for name in sorted(self.services):
            _visit(name, self.services, order, ())
        return [self.services[name] for name in order if name != self.own]

    def host_names(self) -> list[str]:
        """Every name a service answers to in the attempt's network (service names, then aliases)."""
        names = [*self.services, self.own]
        names += [alias for service in self.services.values() for alias in service.aliases]
        return list(dict.fromkeys(names))


def _visit(name: str, services: Mapping[str, ServiceSpec], order: list[str], path: tuple[str, ...]) -> None:
    if name in order or name not in services:
        return
    if name in path:
        raise ComposeError(f"services.{name}.depends_on: a cycle ({' -> '.join([*path, name])})")
    for dependency in services[name].depends_on:
        _visit(dependency, services, order, (*path, name))
    order.append(name)


def read_compose(path: Path, variables: Mapping[str, str], own: str = MAIN_SERVICE) -> ComposeProject:
    """Read the compose file at ``path`` (its directory is the task's ``environment/``), interpolated from
    ``variables``; ``own`` names the task's own service.

    Raises:
        ComposeError: the file is not YAML, not a mapping of services, or a value has the wrong shape (the message
            names the key).
    """
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ComposeError(f"{path.name}: not a readable YAML file ({type(error).__name__})") from error
    if not isinstance(document, dict) or not isinstance(document.get("services") or {}, dict):
        raise ComposeError(f"{path.name}: services must be a mapping of service names")
    reader = _Reader(path, variables)
    document = reader.interpolate(document, "")
    reader.refuse_top_level(document)
    volumes = tuple(str(name) for name in (document.get("volumes") or {}))
    services = {}
    for name, spec in (document.get("services") or {}).items():
        service = reader.service(str(name), spec if spec is not None else {}, volumes, own=str(name) == own)
        if service is not None:
            services[service.name] = service
    project = ComposeProject(path, services, volumes, tuple(reader.refusals), tuple(reader.model_apis), own)
    for service in services.values():
        unknown = sorted(set(service.depends_on) - set(services))
        if unknown:
            raise ComposeError(f"{path.name}: services.{service.name}.depends_on names no service: {unknown}")
    project.helpers  # noqa: B018 - raises on a dependency cycle
    return project


class _Reader:
    """Reads one compose file, collecting refusals and model-API needs as it goes."""

    def __init__(self, path: Path, variables: Mapping[str, str]) -> None:
        self.path = path
        self.context = path.parent
        self.variables = variables
        self.refusals: list[str] = []
        self.model_apis: list[str] = []

    def refuse(self, key: str, why: str) -> None:
        self.refusals.append(f"{self.path.name}: {key}: {why}")

    def interpolate(self, value: Any, key: str) -> Any:
        """``value`` with every string interpolated (mapping keys too, as compose does)."""
        if isinstance(value, str):
            return self._substitute(value, key)
        if isinstance(value, list):
            return [self.interpolate(item, key) for item in value]
        if isinstance(value, dict):
            return {self.interpolate(k, key): self.interpolate(v, f"{key}.{k}".lstrip(".")) for k, v in value.items()}
        return value

    def _substitute(self, text: str, key: str) -> str:
        def value(match: re.Match[str]) -> str:
            if match.group(1):
                return "$"
            name = match.group(2) or match.group(5)
            operator, argument = match.group(3), match.group(4) or ""
            current = self.variables.get(name)
            if operator in (":?", "?") and (current is None or (operator == ":?" and not current)):
                raise ComposeError(f"{self.path.name}: {key}: variable {name} is required ({argument or 'unset'})")
            if operator in (":-", "-") and (current is None or (operator == ":-" and not current)):
                return argument
            if operator in (":+", "+"):
                return argument if current is not None and (operator == "+" or current) else ""
            return current or ""

        return _VARIABLE.sub(value, text)

    def refuse_top_level(self, document: dict) -> None:
        for key in document:
            if key in ("secrets", "configs", "include"):
                self.refuse(key, "not supported without a container engine")

    def service(self, name: str, spec: Any, volumes: tuple[str, ...], own: bool = False) -> ServiceSpec | None:
        """One service, or ``None`` when it does not start by default (``profiles``). The task's own service
        (``own``) keeps Harbor's image and command: its ``build`` and ``image`` are the task's Dockerfile's, and a
        ``command`` or ``entrypoint`` of its own (which would replace Harbor's ``sleep infinity``) is refused."""
        where = f"services.{name}"
        if not isinstance(spec, dict):
            raise ComposeError(f"{self.path.name}: {where} must be a mapping")
        if not _SERVICE_NAME.match(name):
            raise ComposeError(f"{self.path.name}: {where}: not a valid service name")
        if spec.get("profiles"):
            return None
        spec = self._check_keys(where, spec, own)
        environment = {**self._env_files(where, spec.get("env_file")), **mapping(spec.get("environment"), where)}
        if own:  # a harness's plumbing for its own service (Terminal-Bench 1's ${T_BENCH_...}) is blank here
            environment = {name: value for name, value in environment.items() if value}
        self._note_model_api(where, environment)
        return ServiceSpec(
            name=name,
            dockerfile=self._dockerfile(where, spec.get("build")),
            image=optional_str(spec.get("image"), f"{where}.image"),
            entrypoint=words(spec.get("entrypoint"), f"{where}.entrypoint"),
            command=words(spec.get("command"), f"{where}.command"),
            environment=environment,
            working_dir=optional_str(spec.get("working_dir"), f"{where}.working_dir"),
            expose=self._ports(where, spec),
            healthcheck=healthcheck(spec.get("healthcheck"), f"{where}.healthcheck"),
            depends_on=depends_on(spec.get("depends_on"), f"{where}.depends_on"),
            volumes=self._volumes(where, spec.get("volumes"), volumes),
            aliases=tuple(str(spec[k]) for k in ("hostname", "container_name") if spec.get(k)),
            extra_hosts=extra_hosts(spec.get("extra_hosts"), f"{where}.extra_hosts"),
        )

    def _check_keys(self, where: str, spec: dict, own: bool) -> dict:
        """Refuse what cannot be honoured (one line per key); the task's own service without what Harbor's base
        file decides for it (its build, image and keep-alive command)."""
        for key in spec:
            if key == "network_mode" and spec[key] in ("bridge", "default"):
                continue  # the attempt's own network, shared by its services
            if key not in _HANDLED and key not in IGNORED_KEYS:
                self.refuse(f"{where}.{key}", _REFUSED.get(key, "not supported without a container engine"))
        if not own:
            return spec
        for key in ("command", "entrypoint"):
            if key in spec and not _keeps_alive(words(spec[key], f"{where}.{key}")):
                self.refuse(f"{where}.{key}", "the task's own service runs the agent's commands (Harbor's sleep)")
        kept = {key: value for key, value in spec.items() if key not in ("build", "image", "command", "entrypoint")}
        kept["volumes"] = [v for v in spec.get("volumes") or [] if str(v).strip(":")]  # a harness's blank log mounts
        return kept

    def _dockerfile(self, where: str, build: Any) -> Path | None:
        if build is None:
            return None
        if isinstance(build, str):
            build = {"context": build}
        if not isinstance(build, dict):
            raise ComposeError(f"{self.path.name}: {where}.build must be a path or a mapping")
        for key in build:
            if key not in ("context", "dockerfile"):
                self.refuse(f"{where}.build.{key}", "not supported without a container engine")
        context = self._inside(str(build.get("context", ".")), f"{where}.build.context")
        if context is None:
            return None
        return context / str(build.get("dockerfile", "Dockerfile"))

    def _inside(self, relative: str, key: str) -> Path | None:
        """The host path of ``relative`` when it stays inside the task's ``environment/``, else a refusal."""
        if relative.startswith(("http://", "https://", "git@", "git://")):
            self.refuse(key, f"{relative} is outside the task (a remote build context)")
            return None
        path = (self.context / relative).resolve()
        if not path.is_relative_to(self.context.resolve()):
            self.refuse(key, f"{relative} is outside the task's environment/")
            return None
        return path

    def _env_files(self, where: str, env_file: Any) -> dict[str, str]:
        values: dict[str, str] = {}
        for entry in [env_file] if isinstance(env_file, str | dict) else env_file or []:
            relative = entry.get("path") if isinstance(entry, dict) else entry
            path = self._inside(str(relative), f"{where}.env_file")
            if path is None:
                continue
            if not path.is_file():
                if isinstance(entry, dict) and entry.get("required") is False:
                    continue
                raise ComposeError(f"{self.path.name}: {where}.env_file: {relative} does not exist")
            lines = path.read_text(encoding="utf-8").splitlines()
            values |= mapping([line for line in lines if line.strip() and not line.lstrip().startswith("#")], where)
        return values

    def _note_model_api(self, where: str, environment: dict[str, str]) -> None:
        named = [variable for variable in environment if variable in MODEL_API_VARIABLES]
        if named:
            self.model_apis.append(
                f"{self.path.name}: {where}.environment: {', '.join(named)} (the service calls a model API outside "
                "this machine, and attempts run offline)"
            )

    def _ports(self, where: str, spec: dict) -> tuple[int, ...]:
        ports = []
        for key in ("expose", "ports"):
            for entry in spec.get(key) or []:
                text = str(entry.get("target") if isinstance(entry, dict) else entry)
                port = text.split("/")[0].rsplit(":", 1)[-1].split("-")[0]
                if not port.isdigit():
                    raise ComposeError(f"{self.path.name}: {where}.{key}: {entry!r} names no port")
                ports.append(int(port))
        return tuple(dict.fromkeys(ports))

    def _volumes(self, where: str, entries: Any, named: tuple[str, ...]) -> tuple[Volume, ...]:
        volumes = []
        for entry in entries or []:
            if isinstance(entry, dict):
                source, target = entry.get("source"), entry.get("target")
                read_only = bool(entry.get("read_only"))
            else:
                source, target, *options = [*str(entry).split(":"), ""][:3]
                read_only = "ro" in str(options[0]).split(",")
                source, target = (source, target) if target else (None, source)
            if not target or not str(target).startswith("/"):
                raise ComposeError(f"{self.path.name}: {where}.volumes: {entry!r} has no absolute target")
            if source is None or str(source) in named:
                volumes.append(Volume(str(source or f"{where}:{target}"), str(target), read_only))
            elif str(source).startswith((".", "~")) or "/" in str(source):
                path = self._inside(str(source), f"{where}.volumes") if not str(source).startswith("~") else None
                if str(source).startswith("~"):
                    self.refuse(f"{where}.volumes", f"{source} is outside the task's environment/")
                if path is not None:
                    volumes.append(Volume(path, str(target), read_only))
            else:
                self.refuse(f"{where}.volumes", f"{source} is not a volume declared under the file's volumes")
        return tuple(volumes)


def _keeps_alive(command: tuple[str, ...] | None) -> bool:
    """Whether a command only keeps a container alive (Terminal-Bench 1's ``sh -c "sleep infinity"``)."""
    text = " ".join(command or ())
    return not text or "sleep infinity" in text or "tail -f /dev/null" in text or text in ("bash", "sh")


_HANDLED = frozenset(
    {
        "build", "image", "command", "entrypoint", "environment", "env_file", "working_dir", "expose", "ports",
        "healthcheck", "depends_on", "volumes", "hostname", "container_name", "extra_hosts", "profiles",
    }
)  # fmt: skip
_REFUSED = {
    "privileged": "a privileged container (no sandbox here grants the host's devices and capabilities)",
    "devices": "host devices",
    "cap_add": "added capabilities",
    "network_mode": "a network mode other than the attempt's own network (host networking, another container's)",
    "pid": "another PID namespace (the host's)",
    "ipc": "another IPC namespace (the host's)",
    "userns_mode": "the host's user namespace",
    "security_opt": "security options (the sandbox's own apply)",
    "sysctls": "kernel parameters",
    "volumes_from": "another container's volumes",
    "user": "a user other than the image's (USER in the service's Dockerfile is honoured)",
    "gpus": "GPUs",
    "runtime": "another container runtime",
    "secrets": "compose secrets",
    "configs": "compose configs",
    "group_add": "supplementary groups",
    "cgroup_parent": "a host cgroup",
    "links": "legacy links (every service already reaches the others by name)",
}
"""Why each refused service key cannot be honoured here."""


__all__ = [
    "CONDITIONS",
    "HARBOR_VARIABLES",
    "MAIN_SERVICE",
    "MODEL_API_VARIABLES",
    "ComposeError",
    "ComposeProject",
    "Healthcheck",
    "ServiceSpec",
    "Volume",
    "read_compose",
]
