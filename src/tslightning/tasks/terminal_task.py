"""Harbor / Terminal-Bench 2 task directories, loaded as they are.

A task directory::

    task-name/
    ├── instruction.md        the prompt the agent sees
    ├── task.toml             limits and metadata (Harbor's schema, read by tasks/harbor/task_config.py)
    ├── environment/          the Dockerfile (or ``docker_image``) and the files it copies
    ├── tests/test.sh         the verifier; writes /logs/verifier/reward.txt or reward.json
    └── solution/solve.sh     the reference solution (required by validation, optional to load)

A multi-step task (``[[steps]]`` in task.toml) has ``steps/<name>/instruction.md`` per step instead of the root
instruction, and optionally ``steps/<name>/tests/`` (layered over ``tests/``), ``steps/<name>/solution/solve.sh`` and
``steps/<name>/workdir/`` (copied into the working directory before the step; its ``setup.sh`` runs first).

**Seeding /app.** Where a task runs on the host's system (its Dockerfile only copies files into ``/app`` from a
base the host stands in for: :attr:`TerminalTask.needs` is ``host``, see
:mod:`~tslightning.tasks.harbor.environment_needs`), every file under ``environment/`` except the
container build files (:data:`CONTAINER_BUILD_FILES`) is copied into ``/app``, keeping its relative path. The shipped
tasks' Dockerfiles ``COPY`` exactly those files to ``/app``, so the same directory also runs unchanged under Harbor.
"""

from __future__ import annotations

import re
import shutil
import tomllib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from tslightning.sandbox import AttemptDirectory, SandboxLimits
from tslightning.tasks.harbor.dockerfile import DockerfileError
from tslightning.tasks.harbor.environment_needs import COMPOSE_FILES, ComposeError, EnvironmentNeeds, environment_needs
from tslightning.tasks.harbor.field_reader import HarborFormatError
from tslightning.tasks.harbor.task_config import (
    TASK_TOML,
    AgentSettings,
    Artifact,
    EnvironmentSettings,
    StepSettings,
    VerifierSettings,
    read_task_config,
)

__all__ = [
    "AGENT_COMMAND_TIMEOUT_S",
    "CONTAINER_BUILD_FILES",
    "AgentSettings",
    "EnvironmentSettings",
    "TaskFormatError",
    "TaskFormatWarning",
    "TerminalTask",
    "VerifierSettings",
    "find_task_dirs",
    "seta_source_family",
]

INSTRUCTION = "instruction.md"
ENVIRONMENT_DIR = "environment"
TESTS_DIR = "tests"
TEST_SCRIPT = "tests/test.sh"
SOLUTION_SCRIPT = "solution/solve.sh"
STEPS_DIR = "steps"
CONTAINER_BUILD_FILES = frozenset({"Dockerfile", ".dockerignore", *COMPOSE_FILES})
"""Files in ``environment/`` that describe a container image rather than the agent's starting files."""

AGENT_COMMAND_TIMEOUT_S = 120.0
"""Table 6: one agent tool command may run for at most 120 s."""

_SETA_EVOLUTION_SUFFIX = re.compile(r"__[bd]\d+$")


class TaskFormatError(HarborFormatError):
    """A task directory does not follow the Harbor layout; ``problems`` lists every problem found."""

    def __init__(self, task_dir: Path, problems: list[str]) -> None:
        self.task_dir = Path(task_dir)
        self.problems = list(problems)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"task {self.task_dir.name!r} ({self.task_dir}) is not a valid Harbor task:\n{lines}")


class TaskFormatWarning(UserWarning):
    """A task.toml key outside Harbor's schema (ignored, as Harbor ignores it), or a setting honoured in part."""


@dataclass(frozen=True)
class TerminalTask:
    """One Harbor / Terminal-Bench 2 task directory.

    Attributes:
        name: The directory's name: the task id.
        root: The task directory.
        instruction: ``instruction.md``'s text (a multi-step task without one: its first step's).
        schema_version: ``schema_version`` / ``version`` from task.toml.
        metadata: ``[metadata]`` as given (difficulty, category, tags, ...).
        verifier: ``[verifier]`` settings.
        agent: ``[agent]`` settings.
        environment: ``[environment]`` settings.
        solution_env: ``[solution] env``: environment of the reference solution.
        source: Top-level ``source``, if any.
        artifacts: Paths collected from the environment after an attempt (``artifacts``).
        steps: ``[[steps]]`` of a multi-step task (empty for a single-step task).
        multi_step_reward_strategy: How a multi-step task's step rewards make its reward (``mean`` / ``final``).
        warnings: What task.toml holds that is ignored here (each names the key).
        needs: What the task's environment needs (the host's system, a build, an image, helper containers).
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
    artifacts: tuple[Artifact, ...] = ()
    steps: tuple[StepSettings, ...] = ()
    multi_step_reward_strategy: Literal["mean", "final"] = "mean"
    warnings: tuple[str, ...] = ()
    needs: EnvironmentNeeds = field(default_factory=lambda: EnvironmentNeeds("host"))

    @property
    def task_id(self) -> str:
        """The task's id (its directory name), as the rollout DataModule names tasks."""
        return self.name

    @classmethod
    def load(cls, task_dir: str | Path, host_env: Mapping[str, str] | None = None) -> TerminalTask:
        """Load ``task_dir``; raises :class:`TaskFormatError` listing every problem (file and key named).

        Keys outside Harbor's schema do not stop loading: each is a :class:`TaskFormatWarning` (also kept in
        :attr:`warnings`). ``host_env`` resolves ``${VAR}`` in env tables (default: the trainer's environment).
        """
        root = Path(task_dir)
        if not root.is_dir():
            raise TaskFormatError(root, [f"{root} is not a directory"])
        problems: list[str] = []
        parsed = _read_toml(root, problems)
        config = read_task_config(parsed, problems, host_env) if parsed is not None else None
        steps = config.steps if config is not None else ()
        instruction = _read_instruction(root / INSTRUCTION, INSTRUCTION, problems, required=not steps)
        if steps:
            instruction = _check_steps(root, steps, problems) if not instruction else instruction
        elif not (root / TEST_SCRIPT).is_file():
            problems.append(f"{TEST_SCRIPT}: missing (the verifier entrypoint is required)")
        if not (root / ENVIRONMENT_DIR).is_dir():
            problems.append(f"{ENVIRONMENT_DIR}/: missing (the directory seeding /app is required, even if empty)")
        needs = _read_needs(root, config, problems) if config is not None else None
        if problems or config is None or needs is None:
            raise TaskFormatError(root, problems)
        for message in config.warnings:
            warnings.warn(f"task {root.name!r}: {message}", TaskFormatWarning, stacklevel=2)
        return cls(
            name=root.name,
            root=root,
            instruction=instruction,
            schema_version=config.schema_version,
            metadata=config.metadata,
            verifier=config.verifier,
            agent=config.agent,
            environment=config.environment,
            solution_env=config.solution_env,
            source=config.source,
            artifacts=config.artifacts,
            steps=config.steps,
            multi_step_reward_strategy=config.multi_step_reward_strategy,
            warnings=config.warnings,
            needs=needs,
        )

    @property
    def command_env(self) -> dict[str, str]:
        """The environment of every command: the image's ``ENV``, then ``[environment] env`` over it."""
        return {**self.needs.env, **self.environment.env}

    @property
    def workdir(self) -> str:
        """Where commands start: ``[environment] workdir``, else the image's ``WORKDIR``, else ``/app``."""
        return self.environment.workdir or self.needs.workdir or "/app"

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
        """``solution/solve.sh``, or ``None`` when the task ships no reference solution (a multi-step task: its
        steps' solutions, when every step has one)."""
        if self.steps:
            scripts = [self.step_dir(step.name) / SOLUTION_SCRIPT for step in self.steps]
            return scripts[0] if all(script.is_file() for script in scripts) else None
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
    def compose_file(self) -> Path | None:
        """``environment/docker-compose.yaml`` (or another compose file name), if the task has one."""
        return next((p for n in COMPOSE_FILES if (p := self.environment_dir / n).is_file()), None)

    @property
    def group_id(self) -> str:
        """The task's split group: its SETA source family (App. C.2)."""
        return seta_source_family(self.name)

    @property
    def multi_step(self) -> bool:
        return bool(self.steps)

    def step_dir(self, name: str) -> Path:
        return self.root / STEPS_DIR / name

    def step_instruction(self, name: str) -> str:
        return (self.step_dir(name) / INSTRUCTION).read_text(encoding="utf-8")

    def app_files(self) -> Iterator[tuple[Path, Path]]:
        """``(source, path relative to /app)`` for every file that seeds ``/app`` (all but container build files)."""
        for path in sorted(self.environment_dir.rglob("*")):
            relative = path.relative_to(self.environment_dir)
            if path.is_file() and not (len(relative.parts) == 1 and relative.name in CONTAINER_BUILD_FILES):
                yield path, relative

    def open_attempt(self, parent: str | None = None, seed_app: bool = True) -> AttemptDirectory:
        """A fresh attempt directory whose ``app/`` holds :meth:`app_files` (``seed_app``; use it as a context
        manager); the task's own directory is hidden from its commands wherever the sandbox would show it."""
        attempt = AttemptDirectory(parent=parent, hidden=(self.root,))
        try:
            if seed_app:
                self.seed_app(attempt)
        except BaseException:
            attempt.close()
            raise
        return attempt

    def seed_app(self, attempt: AttemptDirectory) -> None:
        """Copy :meth:`app_files` into ``attempt``'s ``app/`` (the host's system standing in for the image)."""
        attempt.wrote_from_host()
        for source, relative in self.app_files():
            target = attempt.app / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)

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


def _read_instruction(path: Path, name: str, problems: list[str], required: bool = True) -> str:
    if not path.is_file():
        if required:
            problems.append(f"{name}: missing (the agent's prompt is required)")
        return ""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        problems.append(f"{name}: not UTF-8 text ({error.reason} at byte {error.start})")
        return ""
    if not text.strip():
        problems.append(f"{name}: empty")
    return text


def _check_steps(root: Path, steps: tuple[StepSettings, ...], problems: list[str]) -> str:
    """Each step's files (its instruction; a test.sh of its own or the task's); returns the first instruction."""
    instructions = []
    for step in steps:
        relative = f"{STEPS_DIR}/{step.name}"
        instructions.append(_read_instruction(root / relative / INSTRUCTION, f"{relative}/{INSTRUCTION}", problems))
        if not (root / relative / TEST_SCRIPT).is_file() and not (root / TEST_SCRIPT).is_file():
            problems.append(f"{relative}/{TEST_SCRIPT}: missing, and no {TEST_SCRIPT} to fall back on")
    return instructions[0] if instructions else ""


def _read_needs(root: Path, config, problems: list[str]) -> EnvironmentNeeds | None:
    """The environment's needs (:mod:`~tslightning.tasks.harbor.environment_needs`); a Dockerfile that cannot be
    read is a problem naming its line."""
    if not (root / ENVIRONMENT_DIR).is_dir():
        return None
    try:
        needs = environment_needs(
            root / ENVIRONMENT_DIR,
            config.environment.docker_image,
            config.verifier.environment_mode,
            compose_variables(root, config.environment),
        )
    except (DockerfileError, ComposeError) as error:
        problems.append(f"{ENVIRONMENT_DIR}/{error}")
        return None
    workdir = config.environment.workdir
    if needs.status == "host" and workdir is not None and workdir != "/app" and not workdir.startswith("/app/"):
        reason = f"task.toml: [environment] workdir {workdir} (the host shows only /app)"
        return replace(needs, status="build", reasons=(reason,))
    return needs


def compose_variables(root: Path, environment: EnvironmentSettings) -> dict[str, str]:
    """What a task's compose file may interpolate, as Harbor gives ``docker compose`` (its own variables, then
    ``[environment] env``); not the trainer's whole environment."""
    harbor = {
        "CONTEXT_DIR": str((root / ENVIRONMENT_DIR).resolve()),
        "MAIN_IMAGE_NAME": f"hb__{root.name.lower()}",
        "CPUS": str(environment.cpus),
        "MEMORY": f"{environment.memory_mb}M",
    }
    return {**harbor, **environment.env}


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
