"""``tslightning tasks migrate``: Terminal-Bench 1 task directories rewritten in the Harbor layout.

A Terminal-Bench 1 task::

    task.yaml             instruction (or descriptions[base]), author, difficulty, category, tags,
                          max_agent_timeout_sec (360), max_test_timeout_sec (60), parser_name (pytest)
    Dockerfile            built with the task directory as its context
    docker-compose.yaml   the harness's one-service template, or extra services
    run-tests.sh          run by the harness with TEST_DIR=/tests; often sources the harness's
                          setup-uv-pytest.sh / run-uv-pytest.sh from there; without one the harness runs its
                          default runner (those two helpers: pytest on tests/test_outputs.py)
    solution.sh           (or solution.yaml: a list of {command: ...})
    tests/                test_outputs.py, ...

becomes ``instruction.md``, ``task.toml`` (the timeouts, metadata, ``[verifier] env`` with ``TEST_DIR``),
``environment/`` (the Dockerfile and every other file of its build context), ``solution/solve.sh`` and ``tests/``:
the original tests, ``run-tests.sh`` (the harness's default runner when the task has none), the harness's two helper
scripts when ``run-tests.sh`` uses them, and a
``test.sh`` that runs ``run-tests.sh`` and turns pytest's ``-rA`` summary (what Terminal-Bench 1's pytest parser
counts) into ``reward.json`` counts and ``reward.txt`` (its exit status when no summary line appears). The harness's
one-service compose template is dropped (Harbor needs none); a compose file with more services is kept as
``environment/docker-compose.yaml`` (a helper-container task). The source is never changed.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tslightning.tasks.harbor.field_reader import HarborFormatError

TB1_FILES = frozenset(
    {"task.yaml", "run-tests.sh", "solution.sh", "solution.yaml", "docker-compose.yaml", "docker-compose.yml", "tests"}
)
HELPER_SCRIPTS = ("setup-uv-pytest.sh", "run-uv-pytest.sh")
DEFAULT_AGENT_TIMEOUT_S = 360.0
DEFAULT_TEST_TIMEOUT_S = 60.0

_SETUP_UV_PYTEST = """#!/bin/bash
# The Terminal-Bench 1 harness's test set-up, as `tslightning tasks migrate` provides it: uv, then a virtual
# environment with pytest in the working directory.
apt-get update
apt-get install -y curl
curl -LsSf https://astral.sh/uv/0.7.13/install.sh | sh
source "$HOME/.local/bin/env"
if [ "$PWD" = "/" ]; then
    echo "Error: no working directory; set a WORKDIR in the Dockerfile" >&2
    exit 1
fi
uv venv .tbench-testing
source .tbench-testing/bin/activate
uv pip install pytest==8.4.1
"""
_DEFAULT_RUN_TESTS = """#!/bin/bash
# The Terminal-Bench 1 harness's default test runner (the task has no run-tests.sh of its own), as
# `tslightning tasks migrate` provides it.
source "$TEST_DIR/setup-uv-pytest.sh"
bash "$TEST_DIR/run-uv-pytest.sh"
"""
_RUN_UV_PYTEST = """#!/bin/bash
# The Terminal-Bench 1 harness's test run, as `tslightning tasks migrate` provides it.
uv run pytest "$TEST_DIR/test_outputs.py" -rA
"""
_TEST_SH = """#!/bin/bash
# Written by `tslightning tasks migrate` (Terminal-Bench 1 -> Harbor): run the task's run-tests.sh as the
# Terminal-Bench 1 harness did, then count pytest's -rA summary lines into the reward files.
export TEST_DIR=/tests
mkdir -p /logs/verifier
output=/logs/verifier/test-output.txt
bash /tests/run-tests.sh > "$output" 2>&1
status=$?
cat "$output"
passed=$(grep -cE '^PASSED ' "$output")
failed=$(grep -cE '^(FAILED|ERROR) ' "$output")
total=$((passed + failed))
if [ "$total" -gt 0 ]; then
    awk -v p="$passed" -v t="$total" 'BEGIN { printf "%.6f\\n", p / t }' > /logs/verifier/reward.txt
    printf '{"tests_passed": %d, "tests_total": %d}\\n' "$passed" "$total" > /logs/verifier/reward.json
elif [ "$status" -eq 0 ]; then
    echo 1 > /logs/verifier/reward.txt
else
    echo 0 > /logs/verifier/reward.txt
fi
"""


class MigrationError(HarborFormatError):
    """A source directory cannot be migrated (the message names the file and the fix)."""


@dataclass
class Migration:
    """What migrating one task did."""

    source: Path
    target: Path
    notes: list[str] = field(default_factory=list)


def is_terminal_bench_1_task(directory: Path) -> bool:
    return (directory / "task.yaml").is_file()


def migrate_tasks(source: Path, target: Path) -> list[Migration]:
    """Migrate ``source`` (one Terminal-Bench 1 task, or a directory of them) into ``target`` (created; a task
    directory there already is refused, nothing is overwritten).

    Raises:
        MigrationError: ``source`` holds no Terminal-Bench 1 task, a target task directory exists, or a
            ``task.yaml`` cannot be read.
    """
    source, target = Path(source), Path(target)
    if not source.is_dir():
        raise MigrationError(f"{source} is not a directory")
    if is_terminal_bench_1_task(source):
        pairs = [(source, target / source.name)]
    else:
        pairs = [(d, target / d.name) for d in sorted(source.iterdir()) if d.is_dir() and is_terminal_bench_1_task(d)]
    if not pairs:
        raise MigrationError(f"{source} holds no Terminal-Bench 1 task (a directory with task.yaml)")
    existing = [str(t) for _, t in pairs if t.exists()]
    if existing:
        raise MigrationError(f"{', '.join(existing)} exist already; migrate into a new directory")
    configs = {s: _read_task_yaml(s) for s, _ in pairs}  # every task.yaml read before anything is written
    return [migrate_task(s, t, configs[s]) for s, t in pairs]


def migrate_task(source: Path, target: Path, config: dict[str, Any] | None = None) -> Migration:
    """Write the Harbor form of the Terminal-Bench 1 task ``source`` into the new directory ``target``."""
    config = _read_task_yaml(source) if config is None else config
    migration = Migration(source, target)
    target.mkdir(parents=True)
    (target / "instruction.md").write_text(_instruction(source, config).rstrip() + "\n")
    (target / "task.toml").write_text(_task_toml(config))
    _environment(source, target / "environment", migration)
    _tests(source, target / "tests", migration)
    _solution(source, target / "solution", migration)
    return migration


def _read_task_yaml(source: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load((source / "task.yaml").read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise MigrationError(f"{source / 'task.yaml'} is not valid YAML: {error}") from None
    if not isinstance(config, dict):
        raise MigrationError(f"{source / 'task.yaml'} must be a mapping of keys; got {type(config).__name__}")
    if not _instruction(source, config):
        raise MigrationError(f"{source / 'task.yaml'} has no instruction (nor descriptions with a 'base' entry)")
    if (source / "tests" / "test.sh").exists():
        raise MigrationError(f"{source / 'tests' / 'test.sh'} exists; it would be replaced by the migrated verifier")
    return config


def _instruction(source: Path, config: dict[str, Any]) -> str:
    if isinstance(config.get("instruction"), str):
        return config["instruction"]
    for entry in config.get("descriptions") or []:  # the older form: [{key: base, description: ...}]
        if isinstance(entry, dict) and entry.get("key") == "base" and isinstance(entry.get("description"), str):
            return entry["description"]
    return ""


def _task_toml(config: dict[str, Any]) -> str:
    metadata = {key: config[key] for key in ("author_name", "author_email", "difficulty", "category") if key in config}
    metadata["tags"] = [str(tag) for tag in config.get("tags") or []]
    for key in ("expert_time_estimate_min", "junior_time_estimate_min"):
        if isinstance(config.get(key), int | float):
            metadata[key] = float(config[key])
    metadata["migrated_from"] = "terminal-bench-1"
    agent = float(config.get("max_agent_timeout_sec") or DEFAULT_AGENT_TIMEOUT_S)
    test = float(config.get("max_test_timeout_sec") or DEFAULT_TEST_TIMEOUT_S)
    lines = ['schema_version = "1.1"', "artifacts = []", "", "[metadata]"]
    lines += [f"{key} = {_toml_value(value)}" for key, value in metadata.items()]
    lines += ["", "[verifier]", f"timeout_sec = {test}", 'env = { TEST_DIR = "/tests" }', ""]
    lines += ["[agent]", f"timeout_sec = {agent}", "", "[environment]", "build_timeout_sec = 600.0", ""]
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def _environment(source: Path, environment: Path, migration: Migration) -> None:
    """The Dockerfile and the rest of its build context (every file that is not one of the harness's)."""
    environment.mkdir()
    if not (source / "Dockerfile").is_file():
        migration.notes.append("no Dockerfile: set [environment] docker_image in task.toml, or add one")
    for path in sorted(source.iterdir()):
        if path.name in TB1_FILES:
            continue
        copy = shutil.copytree if path.is_dir() and not path.is_symlink() else shutil.copy2
        copy(path, environment / path.name, **({"symlinks": True} if copy is shutil.copytree else {}))
    compose = next((source / n for n in ("docker-compose.yaml", "docker-compose.yml") if (source / n).is_file()), None)
    if compose is not None and _extra_services(compose):
        shutil.copy2(compose, environment / "docker-compose.yaml")
        migration.notes.append(
            f"docker-compose has services besides the task's ({', '.join(_extra_services(compose))}): kept as "
            "environment/docker-compose.yaml; the task needs helper containers"
        )


def _extra_services(compose: Path) -> list[str]:
    """Services of a Terminal-Bench 1 compose file besides the one the harness builds from the Dockerfile."""
    try:
        services = (yaml.safe_load(compose.read_text(encoding="utf-8")) or {}).get("services") or {}
    except (yaml.YAMLError, AttributeError, UnicodeDecodeError):
        return ["(unreadable compose file)"]
    return sorted(name for name, spec in services.items() if not _is_task_service(spec))


def _is_task_service(spec: Any) -> bool:
    image = spec.get("image", "") if isinstance(spec, dict) else ""
    return isinstance(spec, dict) and ("build" in spec or "T_BENCH_TASK_DOCKER_CLIENT_IMAGE_NAME" in str(image))


def _tests(source: Path, tests: Path, migration: Migration) -> None:
    if (source / "tests").is_dir():
        shutil.copytree(source / "tests", tests, symlinks=True)
    else:
        tests.mkdir()
    if (source / "run-tests.sh").is_file():
        shutil.copy2(source / "run-tests.sh", tests / "run-tests.sh")
    else:
        (tests / "run-tests.sh").write_text(_DEFAULT_RUN_TESTS)
        migration.notes.append("tests/run-tests.sh: the harness's default runner (the task has none)")
    run_tests = (tests / "run-tests.sh").read_text(encoding="utf-8")
    for name, text in zip(HELPER_SCRIPTS, (_SETUP_UV_PYTEST, _RUN_UV_PYTEST), strict=True):
        if name in run_tests and not (tests / name).exists():
            (tests / name).write_text(text)
            migration.notes.append(f"tests/{name}: the harness's helper, written beside run-tests.sh")
    (tests / "test.sh").write_text(_TEST_SH)


def _solution(source: Path, solution: Path, migration: Migration) -> None:
    solution.mkdir()
    if (source / "solution.sh").is_file():
        shutil.copy2(source / "solution.sh", solution / "solve.sh")
    elif (source / "solution.yaml").is_file():
        steps = yaml.safe_load((source / "solution.yaml").read_text(encoding="utf-8")) or []
        commands = [s["command"] for s in steps if isinstance(s, dict) and isinstance(s.get("command"), str)]
        (solution / "solve.sh").write_text("#!/bin/bash\n" + "\n".join(commands) + "\n")
        migration.notes.append(f"solution.yaml: its {len(commands)} commands written as solution/solve.sh")
    else:
        solution.rmdir()
        migration.notes.append("no solution.sh or solution.yaml: the migrated task has no reference solution")
