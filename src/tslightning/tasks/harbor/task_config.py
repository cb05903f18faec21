"""``task.toml``: Harbor's task schema, read as Harbor reads it.

Every key has Harbor's default, so an empty file is valid. A key outside the schema is not an error (Harbor ignores
it): it becomes a warning naming the file and the key (:attr:`TaskConfig.warnings`). A value of the wrong type is an
error naming the file and the key; all problems are reported together. The schema (Harbor 1.4)::

    schema_version = "1.4"            # or version
    source = "..."
    artifacts = ["/app/out.txt", { source = "/app/logs", destination = "logs", exclude = ["*.tmp"] }]
    multi_step_reward_strategy = "mean"   # or "final" (multi-step tasks only)
    [task]         name, description, authors, keywords (kept as given)
    [metadata]     free-form (difficulty, category, tags, ...)
    [verifier]     timeout_sec = 600.0, env = {}, user, network_mode, allowed_hosts, environment_mode, environment
    [agent]        timeout_sec, user, network_mode, allowed_hosts
    [environment]  build_timeout_sec = 600.0, docker_image, os = "linux", cpus = 1, memory_mb = 2048,
                   storage_mb = 10240, gpus = 0, gpu_types, allow_internet = true, network_mode, allowed_hosts,
                   env = {}, workdir, healthcheck = { command, interval_sec, timeout_sec, start_period_sec,
                   start_interval_sec, retries }, mcp_servers, skills_dir, memory / storage ("2G"-style, deprecated)
    [solution]     env = {}
    [[steps]]      name, agent, verifier, min_reward (a number, or a table of named rewards), healthcheck, artifacts

``env`` values may name the trainer's environment as ``${VAR}`` or ``${VAR:-default}`` (resolved when the task is
loaded; an unset variable without a default is an error naming it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from tslightning.tasks.harbor.field_reader import FieldReader, is_number, where

TASK_TOML = "task.toml"
NetworkMode = Literal["public", "no-network", "allowlist"]

_TOP = frozenset(
    {
        "version", "schema_version", "source", "task", "metadata", "verifier", "agent", "environment", "solution",
        "artifacts", "steps", "multi_step_reward_strategy",
    }
)  # fmt: skip
_KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": _TOP,
    "verifier": frozenset(
        {"timeout_sec", "env", "user", "network_mode", "allowed_hosts", "environment_mode", "environment"}
    ),
    "agent": frozenset({"timeout_sec", "user", "network_mode", "allowed_hosts", "setup_timeout_sec"}),
    "environment": frozenset(
        {
            "build_timeout_sec", "docker_image", "os", "cpus", "memory_mb", "storage_mb", "gpus", "gpu_types",
            "allow_internet", "network_mode", "allowed_hosts", "mcp_servers", "env", "skills_dir", "healthcheck",
            "workdir", "memory", "storage",
        }
    ),
    "solution": frozenset({"env"}),
    "healthcheck": frozenset(
        {"command", "interval_sec", "timeout_sec", "start_period_sec", "start_interval_sec", "retries"}
    ),
    "steps": frozenset({"name", "agent", "verifier", "min_reward", "healthcheck", "artifacts"}),
    "artifact": frozenset({"source", "destination", "exclude"}),
}  # fmt: skip
_NETWORK_MODES = ("public", "no-network", "allowlist")
_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_STEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


@dataclass(frozen=True)
class HealthcheckSettings:
    """``healthcheck``: a command run after the environment starts until it succeeds ``retries`` times in a row
    (Docker's HEALTHCHECK semantics); the agent starts only on a healthy environment."""

    command: str
    interval_sec: float = 5.0
    timeout_sec: float = 30.0
    start_period_sec: float = 0.0
    start_interval_sec: float = 5.0
    retries: int = 3


@dataclass(frozen=True)
class VerifierSettings:
    """``[verifier]``: how long ``tests/test.sh`` may run, the environment it gets, and where it runs."""

    timeout_sec: float = 600.0
    env: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    environment_mode: Literal["shared", "separate"] | None = None
    """``separate`` (or a ``[verifier.environment]``): a verifier container of its own, which needs a container
    engine (see :mod:`tslightning.tasks.validation`)."""


@dataclass(frozen=True)
class AgentSettings:
    """``[agent]``: the whole attempt's time budget (``None``: the trainer's own limit applies)."""

    timeout_sec: float | None = None
    user: str | None = None


@dataclass(frozen=True)
class EnvironmentSettings:
    """``[environment]``: the resources, network and start-up of the task's environment (Harbor's defaults)."""

    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    os: str = "linux"
    cpus: int = 1
    memory_mb: int = 2048
    storage_mb: int = 10240
    gpus: int = 0
    allow_internet: bool = True
    network_mode: NetworkMode | None = None
    allowed_hosts: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    """Working directory of every command (overrides the image's WORKDIR); ``None``: the image's, else ``/app``."""
    healthcheck: HealthcheckSettings | None = None
    mcp_servers: int = 0
    """How many MCP servers the task offers the agent (the terminal agent uses none)."""

    @property
    def network(self) -> NetworkMode:
        """The effective policy: ``network_mode``, else ``allow_internet`` (``public`` / ``no-network``)."""
        if self.network_mode is not None:
            return self.network_mode
        return "public" if self.allow_internet else "no-network"


@dataclass(frozen=True)
class Artifact:
    """One ``artifacts`` entry: a path in the environment collected after the attempt."""

    source: str
    destination: str | None = None
    exclude: tuple[str, ...] = ()


@dataclass(frozen=True)
class StepSettings:
    """One ``[[steps]]`` entry of a multi-step task (its files are under ``steps/<name>/``); its agent and verifier
    settings are the task's, overridden key by key (env tables merged)."""

    name: str
    agent: AgentSettings = field(default_factory=AgentSettings)
    verifier: VerifierSettings = field(default_factory=VerifierSettings)
    min_reward: float | dict[str, float] | None = None
    """Abort the remaining steps when this step's reward (a number) or any named reward (a table) is below it."""
    healthcheck: HealthcheckSettings | None = None
    artifacts: tuple[Artifact, ...] = ()


@dataclass(frozen=True)
class TaskConfig:
    """``task.toml`` as read (see the module docstring)."""

    schema_version: str = "1.0"
    source: str | None = None
    package: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    verifier: VerifierSettings = field(default_factory=VerifierSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    environment: EnvironmentSettings = field(default_factory=EnvironmentSettings)
    solution_env: dict[str, str] = field(default_factory=dict)
    artifacts: tuple[Artifact, ...] = ()
    steps: tuple[StepSettings, ...] = ()
    multi_step_reward_strategy: Literal["mean", "final"] = "mean"
    warnings: tuple[str, ...] = ()
    """Keys outside the schema, and settings honoured only in part here; each names the file and the key."""


def read_task_config(
    config: dict[str, Any], problems: list[str], host_env: Mapping[str, str] | None = None
) -> TaskConfig:
    """``config`` (parsed TOML) as a :class:`TaskConfig`; each bad value appends a problem naming the key."""
    reader = _TomlReader(problems, os.environ if host_env is None else host_env)
    reader.note_unknown("", config)
    sections = {name: reader.table(config, name) for name in ("verifier", "agent", "environment", "solution")}
    for name, section in sections.items():
        reader.note_unknown(name, section)
    version = config.get("schema_version", config.get("version", "1.0"))
    strategy = config.get("multi_step_reward_strategy", "mean")
    if strategy not in ("mean", "final"):
        reader.bad("", "multi_step_reward_strategy", "'mean' or 'final'", strategy)
        strategy = "mean"
    verifier = reader.verifier("verifier", sections["verifier"])
    agent = reader.agent("agent", sections["agent"])
    return TaskConfig(
        schema_version=reader.string("", "schema_version", version),
        source=_optional(reader.string, "", "source", config.get("source")),
        package=reader.table(config, "task"),
        metadata=reader.table(config, "metadata"),
        verifier=verifier,
        agent=agent,
        environment=reader.environment(sections["environment"]),
        solution_env=reader.env("solution", sections["solution"].get("env", {})),
        artifacts=reader.artifacts("", config.get("artifacts", [])),
        steps=reader.steps(config.get("steps"), verifier, agent),
        multi_step_reward_strategy=strategy,
        warnings=tuple(reader.warnings),
    )


def resolve_template(value: str, host_env: Mapping[str, str]) -> str:
    """``value`` with each ``${VAR}`` / ``${VAR:-default}`` replaced from ``host_env``.

    Raises:
        KeyError: a variable without a default is not set (the message names it).
    """

    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        if name in host_env:
            return host_env[name]
        if default is not None:
            return default
        raise KeyError(name)

    return _TEMPLATE.sub(substitute, value)


def _optional(read, section: str, key: str, value: Any) -> Any:
    return None if value is None else read(section, key, value)


class _TomlReader(FieldReader):
    """task.toml's tables read into settings; a bad value appends a problem, an unknown key a warning."""

    def __init__(self, problems: list[str], host_env: Mapping[str, str]) -> None:
        super().__init__(TASK_TOML, problems)
        self.warnings: list[str] = []
        self.host_env = host_env

    def note_unknown(self, section: str, table: dict[str, Any], kind: str | None = None) -> None:
        known = _KNOWN_KEYS[kind or section]
        for key in sorted(set(table) - known):
            self.warnings.append(f"{TASK_TOML}: unknown key {where(section, key)} ignored (as Harbor does)")

    def table(self, config: dict[str, Any], name: str, section: str = "") -> dict[str, Any]:
        table = config.get(name, {})
        if not isinstance(table, dict):
            self.problems.append(f"{TASK_TOML}: [{where(section, name)}] must be a table; got {table!r}")
            return {}
        return table

    def verifier(self, section: str, table: dict[str, Any], under: VerifierSettings | None = None) -> VerifierSettings:
        """``table`` as verifier settings; a step's (``under``: the task's) takes the task's timeout unless it sets
        its own, and its env over the task's."""
        mode = table.get("environment_mode")
        if mode not in (None, "shared", "separate"):
            self.bad(section, "environment_mode", "'shared' or 'separate'", mode)
            mode = None
        if mode is None and isinstance(table.get("environment"), dict):
            mode = "separate"  # Harbor: a verifier environment implies its own container
        self.network(section, table)
        under = under or VerifierSettings()
        return VerifierSettings(
            timeout_sec=self.positive(section, "timeout_sec", table.get("timeout_sec", under.timeout_sec)),
            env={**under.env, **self.env(section, table.get("env", {}))},
            user=self.user(section, table.get("user")) or under.user,
            environment_mode=mode or under.environment_mode,
        )

    def agent(self, section: str, table: dict[str, Any], under: AgentSettings | None = None) -> AgentSettings:
        under = under or AgentSettings()
        self.network(section, table)
        timeout = _optional(self.positive, section, "timeout_sec", table.get("timeout_sec", under.timeout_sec))
        return AgentSettings(timeout_sec=timeout, user=self.user(section, table.get("user")) or under.user)

    def environment(self, table: dict[str, Any]) -> EnvironmentSettings:
        section = "environment"
        memory_mb = self.count(section, "memory_mb", table.get("memory_mb", 2048))
        storage_mb = self.count(section, "storage_mb", table.get("storage_mb", 10240))
        if "memory" in table:  # Harbor's deprecated "2G"-style size wins, as in Harbor
            memory_mb = self.size_mb(section, "memory", table["memory"])
        if "storage" in table:
            storage_mb = self.size_mb(section, "storage", table["storage"])
        network_mode, hosts = self.network(section, table)
        healthcheck = self.healthcheck(section, table.get("healthcheck"))
        servers = table.get("mcp_servers", [])
        return EnvironmentSettings(
            build_timeout_sec=self.positive(section, "build_timeout_sec", table.get("build_timeout_sec", 600.0)),
            docker_image=_optional(self.string, section, "docker_image", table.get("docker_image")),
            os=str(self.string(section, "os", table.get("os", "linux"))).lower(),
            cpus=self.count(section, "cpus", table.get("cpus", 1)),
            memory_mb=memory_mb,
            storage_mb=storage_mb,
            gpus=self.count(section, "gpus", table.get("gpus", 0), minimum=0),
            allow_internet=self.boolean(section, "allow_internet", table.get("allow_internet", True)),
            network_mode=network_mode,
            allowed_hosts=hosts,
            env=self.env(section, table.get("env", {})),
            workdir=self.absolute_path(section, "workdir", table.get("workdir")),
            healthcheck=healthcheck,
            mcp_servers=len(servers) if isinstance(servers, list) else 0,
        )

    def network(self, section: str, table: dict[str, Any]) -> tuple[NetworkMode | None, tuple[str, ...]]:
        mode, hosts = table.get("network_mode"), table.get("allowed_hosts", [])
        if mode is not None and mode not in _NETWORK_MODES:
            self.bad(section, "network_mode", f"one of {list(_NETWORK_MODES)}", mode)
            mode = None
        if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
            self.bad(section, "allowed_hosts", "a list of host names", hosts)
            hosts = []
        if hosts and mode is None:
            mode = "allowlist"  # Harbor: hosts without a mode mean an allowlist
        return mode, tuple(hosts)

    def healthcheck(self, section: str, value: Any) -> HealthcheckSettings | None:
        if value is None:
            return None
        where = f"{section}.healthcheck" if section else "healthcheck"
        if not isinstance(value, dict) or not isinstance(value.get("command"), str):
            self.bad(section, "healthcheck", "a table with a 'command' string", value)
            return None
        self.note_unknown(where, value, "healthcheck")
        seconds = {
            key: self.positive(where, key, value[key], allow_zero=True)
            for key in ("interval_sec", "timeout_sec", "start_period_sec", "start_interval_sec")
            if key in value
        }
        retries = self.count(where, "retries", value.get("retries", 3))
        return HealthcheckSettings(command=value["command"], retries=retries, **seconds)

    def artifacts(self, section: str, value: Any) -> tuple[Artifact, ...]:
        if not isinstance(value, list):
            self.bad(section, "artifacts", "a list of paths or {source, destination, exclude} tables", value)
            return ()
        found = []
        for entry in value:
            if isinstance(entry, str) and entry:
                found.append(Artifact(source=entry))
            elif isinstance(entry, dict) and isinstance(entry.get("source"), str):
                self.note_unknown(where(section, "artifacts"), entry, "artifact")
                destination = entry.get("destination")
                exclude = entry.get("exclude", [])
                if destination is not None and not isinstance(destination, str):
                    self.bad(section, "artifacts destination", "a string", destination)
                if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
                    self.bad(section, "artifacts exclude", "a list of patterns", exclude)
                    exclude = []
                found.append(Artifact(entry["source"], destination if isinstance(destination, str) else None,
                                      tuple(exclude)))  # fmt: skip
            else:
                self.bad(section, "artifacts", "paths or tables with a 'source' string", entry)
        return tuple(found)

    def steps(self, value: Any, verifier: VerifierSettings, agent: AgentSettings) -> tuple[StepSettings, ...]:
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(step, dict) for step in value):
            self.bad("", "steps", "an array of tables ([[steps]])", value)
            return ()
        steps, names = [], set()
        for index, table in enumerate(value):
            where = f"steps[{index}]"
            self.note_unknown(where, table, "steps")
            name = table.get("name")
            if not isinstance(name, str) or not _STEP_NAME.match(name) or name in names:
                self.bad(where, "name", "a unique directory name (letters, digits, '.', '_', '-')", name)
                continue
            names.add(name)
            steps.append(
                StepSettings(
                    name=name,
                    agent=self.agent(f"{where}.agent", self.table(table, "agent", where), agent),
                    verifier=self.verifier(f"{where}.verifier", self.table(table, "verifier", where), verifier),
                    min_reward=self.min_reward(where, table.get("min_reward")),
                    healthcheck=self.healthcheck(where, table.get("healthcheck")),
                    artifacts=self.artifacts(where, table.get("artifacts", [])),
                )
            )
        return tuple(steps)

    def min_reward(self, section: str, value: Any) -> float | dict[str, float] | None:
        if value is None or is_number(value):
            return None if value is None else float(value)
        if isinstance(value, dict) and all(isinstance(k, str) and is_number(v) for k, v in value.items()):
            return {key: float(threshold) for key, threshold in value.items()}
        self.bad(section, "min_reward", "a number or a table of named rewards", value)
        return None

    def env(self, section: str, value: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
            self.bad(section, "env", "a table of strings", value)
            return {}
        resolved = {}
        for name, template in value.items():
            try:
                resolved[name] = resolve_template(template, self.host_env)
            except KeyError as missing:
                variable = missing.args[0]
                self.problems.append(
                    f"{TASK_TOML}: {where(section, 'env')}.{name} needs ${{{variable}}} from the trainer's "
                    f"environment, which is not set; export it, or give a default (${{{variable}:-value}})"
                )
        return resolved
