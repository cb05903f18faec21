"""Harbor / Terminal-Bench 2 task directories, loaded as they are.

A task directory::

    task-name/
    ├── instruction.md        the prompt the agent sees
    ├── task.toml             limits and metadata (Harbor's schema, below)
    ├── environment/          what the agent starts from; a Dockerfile may sit here
    ├── tests/test.sh         the verifier; writes /logs/verifier/reward.txt or reward.json
    └── solution/solve.sh     the reference solution (required by validation, optional to load)

**Seeding /app.** Our sandbox runs tasks that need no image of their own on the host's minimal Debian userland, so
a task's Dockerfile is not built: every file under ``environment/`` except the container build files
(:data:`CONTAINER_BUILD_FILES`) is copied into ``/app``, keeping its relative path. The shipped tasks' Dockerfiles
``COPY`` exactly those files to ``/app``, so the same directory also runs unchanged under Harbor with Docker.

**task.toml** follows Harbor's ``TaskConfig``; every key has Harbor's default, so an empty file is valid. Keys
outside Harbor's schema and values of the wrong type are errors that name the file and the key; all problems are
reported in one :class:`TaskFormatError`::

    version = "1.0"                 # or schema_version
    source = "..."                  # optional
    [task]                          # package info (name, description, authors, keywords), kept as given
    [metadata]                      # free-form (difficulty, category, tags, ...), kept as given
    [verifier]   timeout_sec = 600.0, env = {}, user, network_mode, allowed_hosts
    [agent]      timeout_sec (none by default), user, network_mode, allowed_hosts
    [environment] build_timeout_sec = 600.0, docker_image, cpus = 1, memory_mb = 2048, storage_mb = 10240,
                 gpus = 0, gpu_types, allow_internet = true, network_mode, allowed_hosts, mcp_servers, env,
                 skills_dir, healthcheck, memory / storage (deprecated "2G"-style sizes)
    [solution]   env = {}
"""

from __future__ import annotations

import re
import shutil
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tslightning.sandbox import AttemptDirectory, SandboxLimits

INSTRUCTION = "instruction.md"
TASK_TOML = "task.toml"
ENVIRONMENT_DIR = "environment"
TESTS_DIR = "tests"
TEST_SCRIPT = "tests/test.sh"
SOLUTION_SCRIPT = "solution/solve.sh"

CONTAINER_BUILD_FILES = frozenset({"Dockerfile", ".dockerignore", "docker-compose.yaml", "docker-compose.yml"})
"""Files in ``environment/`` that describe a container image rather than the agent's starting files."""

AGENT_COMMAND_TIMEOUT_S = 120.0
"""Table 6: one agent tool command may run for at most 120 s."""

_KNOWN_KEYS: dict[str, frozenset[str]] = {
    "": frozenset(
        {"version", "schema_version", "source", "task", "metadata", "verifier", "agent", "environment", "solution"}
    ),
    "verifier": frozenset({"timeout_sec", "env", "user", "network_mode", "allowed_hosts"}),
    "agent": frozenset({"timeout_sec", "user", "network_mode", "allowed_hosts"}),
    "environment": frozenset(
        {
            "build_timeout_sec", "docker_image", "cpus", "memory_mb", "storage_mb", "gpus", "gpu_types",
            "allow_internet", "network_mode", "allowed_hosts", "mcp_servers", "env", "skills_dir", "healthcheck",
            "memory", "storage",
        }
    ),
    "solution": frozenset({"env"}),
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG])B?\s*$", re.IGNORECASE)
_SETA_EVOLUTION_SUFFIX = re.compile(r"__[bd]\d+$")


class TaskFormatError(ValueError):
    """A task directory does not follow the Harbor layout; ``problems`` lists every problem found."""

    def __init__(self, task_dir: Path, problems: list[str]) -> None:
        self.task_dir = Path(task_dir)
        self.problems = list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"task {self.task_dir.name!r} ({self.task_dir}) is not a valid Harbor task:\n{lines}")


@dataclass(frozen=True)
class VerifierSettings:
    """``[verifier]``: how long ``tests/test.sh`` may run and the environment it gets."""

    timeout_sec: float = 600.0
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AgentSettings:
    """``[agent]``: the whole attempt's time budget (``None``: the trainer's own limit applies)."""

    timeout_sec: float | None = None


@dataclass(frozen=True)
class EnvironmentSettings:
    """``[environment]``: the resources a task asks for (Harbor's defaults)."""

    build_timeout_sec: float = 600.0
    docker_image: str | None = None
    cpus: int = 1
    memory_mb: int = 2048
    storage_mb: int = 10240
    gpus: int = 0
    allow_internet: bool = True
    env: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TerminalTask:
    """One Harbor / Terminal-Bench 2 task directory.

    Attributes:
        name: The directory's name: the task id.
        root: The task directory.
        instruction: ``instruction.md``'s text.
        schema_version: ``version`` / ``schema_version`` from task.toml.
        metadata: ``[metadata]`` as given (difficulty, category, tags, ...).
        verifier: ``[verifier]`` settings.
        agent: ``[agent]`` settings.
        environment: ``[environment]`` settings.
        solution_env: ``[solution] env``: environment of the reference solution.
        source: Top-level ``source``, if any.
    """

    name: str
    root: Path
    instruction: str
    schema_version: str = "1.0"
    metadata: dict[str, Any] = field(default_factory=dict)
    verifier: VerifierSettings = field(default_factory=VerifierSettings)
    agent: AgentSettings = field(default_factory=AgentSettings)
    environment: EnvironmentSettings = field(default_factory=EnvironmentSettings)
    solution_env: dict[str, str] = field(default_factory=dict)
    source: str | None = None

    @property
    def task_id(self) -> str:
        """The task's id (its directory name), as the rollout DataModule names tasks."""
        return self.name

    @classmethod
    def load(cls, task_dir: str | Path) -> TerminalTask:
        """Load ``task_dir``; raises :class:`TaskFormatError` listing every problem (file and key named)."""
        root = Path(task_dir)
        if not root.is_dir():
            raise TaskFormatError(root, [f"{root} is not a directory"])
        problems: list[str] = []
        instruction = _read_instruction(root, problems)
        config = _read_toml(root, problems)
        if not (root / TEST_SCRIPT).is_file():
            problems.append(f"{TEST_SCRIPT}: missing (the verifier entrypoint is required)")
        if not (root / ENVIRONMENT_DIR).is_dir():
            problems.append(f"{ENVIRONMENT_DIR}/: missing (the directory seeding /app is required, even if empty)")
        task = _task_from_config(root, instruction, config, problems) if config is not None else None
        if problems or task is None:
            raise TaskFormatError(root, problems)
        return task

    @property
    def environment_dir(self) -> Path:
        return self.root / ENVIRONMENT_DIR

    @property
    def tests_dir(self) -> Path:
        return self.root / TESTS_DIR

    @property
    def test_script(self) -> Path:
        return self.root / TEST_SCRIPT

    @property
    def solution_script(self) -> Path | None:
        """``solution/solve.sh``, or ``None`` when the task ships no reference solution."""
        path = self.root / SOLUTION_SCRIPT
        return path if path.is_file() else None

    @property
    def solution_dir(self) -> Path:
        return self.root / "solution"

    @property
    def dockerfile(self) -> Path | None:
        path = self.environment_dir / "Dockerfile"
        return path if path.is_file() else None

    @property
    def group_id(self) -> str:
        """The task's split group: its SETA source family (App. C.2)."""
        return seta_source_family(self.name)

    def app_files(self) -> Iterator[tuple[Path, Path]]:
        """``(source, path relative to /app)`` for every file that seeds ``/app`` (all but container build files)."""
        for path in sorted(self.environment_dir.rglob("*")):
            relative = path.relative_to(self.environment_dir)
            if path.is_file() and not (len(relative.parts) == 1 and relative.name in CONTAINER_BUILD_FILES):
                yield path, relative

    def open_attempt(self, parent: str | None = None) -> AttemptDirectory:
        """A fresh attempt directory whose ``app/`` holds :meth:`app_files` (use it as a context manager); the task's
        own directory is hidden from its commands wherever the sandbox would show it."""
        attempt = AttemptDirectory(parent=parent, hidden=(self.root,))
        try:
            for source, relative in self.app_files():
                target = attempt.app / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target, follow_symlinks=False)
        except BaseException:
            attempt.close()
            raise
        return attempt

    def sandbox_limits(self, timeout_s: float) -> SandboxLimits:
        """The task's ``[environment]`` resources as sandbox limits for a command of ``timeout_s``.

        ``memory_mb`` → ``memory_bytes``: the address space of each process and the resident memory of the whole
        command; ``storage_mb`` → ``disk_bytes``, the disk the attempt uses in all (``/app``, the private ``/tmp``),
        and ``file_size_bytes``, the largest file; ``cpus`` → CPU seconds per process, ``cpus × timeout_s`` (all
        cores busy for the whole timeout).
        """
        storage = self.environment.storage_mb * 2**20
        return SandboxLimits(
            timeout_s=timeout_s,
            cpu_seconds=max(1, round(self.environment.cpus * timeout_s)),
            memory_bytes=self.environment.memory_mb * 2**20,
            file_size_bytes=storage,
            disk_bytes=storage,
        )

    def agent_limits(self, command_timeout_s: float = AGENT_COMMAND_TIMEOUT_S) -> SandboxLimits:
        """Limits of one agent tool command (Table 6's 120 s, never above the task's own agent timeout)."""
        timeout = command_timeout_s
        if self.agent.timeout_sec is not None:
            timeout = min(timeout, self.agent.timeout_sec)
        return self.sandbox_limits(timeout)

    def verifier_limits(self) -> SandboxLimits:
        """Limits of the verifier run: ``[verifier] timeout_sec``."""
        return self.sandbox_limits(self.verifier.timeout_sec)


def seta_source_family(task_id: str) -> str:
    """SETA's split group: the task id without an evolved variant's ``__b<k>`` / ``__d<k>`` suffix (App. C.2)."""
    return _SETA_EVOLUTION_SUFFIX.sub("", task_id)


def find_task_dirs(path: str | Path) -> list[Path]:
    """``path`` itself when it is a task directory (has ``task.toml``), else its task subdirectories, sorted."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    if (root / TASK_TOML).is_file():
        return [root]
    return sorted(child for child in root.iterdir() if child.is_dir() and (child / TASK_TOML).is_file())


def _read_instruction(root: Path, problems: list[str]) -> str:
    path = root / INSTRUCTION
    if not path.is_file():
        problems.append(f"{INSTRUCTION}: missing (the agent's prompt is required)")
        return ""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        problems.append(f"{INSTRUCTION}: not UTF-8 text ({error.reason} at byte {error.start})")
        return ""
    if not text.strip():
        problems.append(f"{INSTRUCTION}: empty")
    return text


def _read_toml(root: Path, problems: list[str]) -> dict[str, Any] | None:
    path = root / TASK_TOML
    if not path.is_file():
        problems.append(f"{TASK_TOML}: missing")
        return None
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        problems.append(f"{TASK_TOML}: not valid TOML ({error})")
        return None


def _task_from_config(root: Path, instruction: str, config: dict[str, Any], problems: list[str]) -> TerminalTask:
    reader = _TomlReader(problems)
    reader.reject_unknown("", config)
    sections = {name: reader.section(config, name) for name in ("verifier", "agent", "environment", "solution")}
    for name, section in sections.items():
        reader.reject_unknown(name, section)
    version = config.get("schema_version", config.get("version", "1.0"))
    verifier, agent, environment = sections["verifier"], sections["agent"], sections["environment"]
    return TerminalTask(
        name=root.name,
        root=root,
        instruction=instruction,
        schema_version=reader.string("", "version", version),
        metadata=reader.section(config, "metadata"),
        verifier=VerifierSettings(
            timeout_sec=reader.positive("verifier", "timeout_sec", verifier.get("timeout_sec", 600.0)),
            env=reader.string_map("verifier", "env", verifier.get("env", {})),
        ),
        agent=AgentSettings(timeout_sec=_optional(reader.positive, "agent", "timeout_sec", agent.get("timeout_sec"))),
        environment=_environment_settings(reader, environment),
        solution_env=reader.string_map("solution", "env", sections["solution"].get("env", {})),
        source=_optional(reader.string, "", "source", config.get("source")),
    )


def _environment_settings(reader: _TomlReader, section: dict[str, Any]) -> EnvironmentSettings:
    memory_mb = reader.count("environment", "memory_mb", section.get("memory_mb", 2048))
    storage_mb = reader.count("environment", "storage_mb", section.get("storage_mb", 10240))
    if "memory" in section:  # Harbor's deprecated "2G"-style size wins, as in Harbor
        memory_mb = reader.size_mb("environment", "memory", section["memory"])
    if "storage" in section:
        storage_mb = reader.size_mb("environment", "storage", section["storage"])
    return EnvironmentSettings(
        build_timeout_sec=reader.positive("environment", "build_timeout_sec", section.get("build_timeout_sec", 600.0)),
        docker_image=_optional(reader.string, "environment", "docker_image", section.get("docker_image")),
        cpus=reader.count("environment", "cpus", section.get("cpus", 1)),
        memory_mb=memory_mb,
        storage_mb=storage_mb,
        gpus=reader.count("environment", "gpus", section.get("gpus", 0), minimum=0),
        allow_internet=reader.boolean("environment", "allow_internet", section.get("allow_internet", True)),
        env=reader.string_map("environment", "env", section.get("env", {})),
    )


def _optional(read, section: str, key: str, value: Any) -> Any:
    return None if value is None else read(section, key, value)


class _TomlReader:
    """Typed reads of task.toml values; each bad value adds a problem naming the file and key."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems

    def _bad(self, section: str, key: str, expected: str, value: Any) -> None:
        self.problems.append(f"{TASK_TOML}: {_where(section, key)} must be {expected}; got {value!r}")

    def reject_unknown(self, section: str, table: dict[str, Any]) -> None:
        for key in sorted(set(table) - _KNOWN_KEYS[section]):
            known = ", ".join(sorted(_KNOWN_KEYS[section]))
            self.problems.append(f"{TASK_TOML}: unknown key {_where(section, key)} (known: {known})")

    def section(self, config: dict[str, Any], name: str) -> dict[str, Any]:
        table = config.get(name, {})
        if not isinstance(table, dict):
            self.problems.append(f"{TASK_TOML}: [{name}] must be a table; got {table!r}")
            return {}
        return table

    def positive(self, section: str, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            self._bad(section, key, "a positive number of seconds", value)
            return 1.0
        return float(value)

    def count(self, section: str, key: str, value: Any, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self._bad(section, key, f"an integer ≥ {minimum}", value)
            return max(minimum, 1)
        return value

    def boolean(self, section: str, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self._bad(section, key, "true or false", value)
            return False
        return value

    def string(self, section: str, key: str, value: Any) -> str:
        if not isinstance(value, str):
            self._bad(section, key, "a string", value)
            return ""
        return value

    def string_map(self, section: str, key: str, value: Any) -> dict[str, str]:
        if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
            self._bad(section, key, "a table of strings", value)
            return {}
        return dict(value)

    def size_mb(self, section: str, key: str, value: Any) -> int:
        match = _SIZE.match(value) if isinstance(value, str) else None
        if match is None:
            self._bad(section, key, "a size such as '2G' or '512M'", value)
            return 1
        number, unit = float(match.group(1)), match.group(2).upper()
        return max(1, int(number * {"K": 1 / 1024, "M": 1, "G": 1024}[unit]))


def _where(section: str, key: str) -> str:
    return f"[{section}] {key}" if section else key
