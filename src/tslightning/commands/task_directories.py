"""``tslightning tasks``: check task directories (``validate``), rewrite Terminal-Bench 1 ones (``migrate``), and
prepare the offline verifier toolchain their tests use (``toolchain``)."""

from __future__ import annotations

import sys
from pathlib import Path

from tslightning.sandbox import Backend, SandboxUnavailableError
from tslightning.tasks.environment.offline_toolchain import fill_wheel_cache, prepare_toolchain, requirements_of
from tslightning.tasks.harbor.migration import MigrationError, migrate_tasks
from tslightning.tasks.rewards import RewardScheme
from tslightning.tasks.terminal_task import find_task_dirs
from tslightning.tasks.validation import format_table, library_dir, sandbox_factory, validate_tasks


def tasks_validate(
    path: Path | None = None,
    backend: Backend = "bubblewrap",
    scheme: RewardScheme = "seta",
    workers: int = 2,
    reward_key: str = "reward",
    allow_internet: bool = False,
) -> None:
    """Check terminal tasks: the reference solution passes and the no-op agent does not (App. C.2).

    Usage: ``tslightning tasks validate [DIR]``. For each task, two fresh sandbox attempts: one where the agent does
    nothing, one that runs ``solution/solve.sh``; the verifier scores both. Prints a table (each task's status:
    valid, invalid, needs image, needs network at build, needs helper container, needs model API; build and set-up
    seconds; each helper service's start-up seconds) and exits
    1 naming each task whose reference does not fully pass or whose no-op already passes (with the verifier output's
    tail), and each task whose environment cannot be provided here (with the reason; no attempt is run).

    Args:
        path: A task directory or a directory of task directories (default: the shipped library).
        backend: Sandbox backend of the attempts.
        scheme: Reward scheme of the reported rewards (``seta``: p + 0.5·1[p = 1]; ``binary``).
        workers: Tasks validated at once.
        reward_key: The named reward of a verifier's ``reward.json`` read as the pass fraction.
        allow_internet: Let tasks whose ``[environment]`` allows the internet reach it (default: all offline).
    """
    try:
        results = validate_tasks(
            path,
            scheme=scheme,
            workers=workers,
            make_attempt_sandbox=sandbox_factory(backend),
            reward_key=reward_key,
            allow_internet=allow_internet,
            containers=backend if backend in ("docker", "podman") else False,
        )
    except (FileNotFoundError, SandboxUnavailableError) as error:
        print(f"tasks validate: {error}", file=sys.stderr)
        sys.exit(2)
    print(format_table(results))
    failed = [result.task for result in results if result.status == "invalid"]
    unmet = [f"{result.task} ({result.status})" for result in results if result.needs is not None]
    if failed:
        print(f"tasks validate: {len(failed)} invalid task(s): {', '.join(failed)}", file=sys.stderr)
    if unmet:
        print(f"tasks validate: {len(unmet)} task(s) cannot run here: {', '.join(unmet)}", file=sys.stderr)
    if failed or unmet:
        sys.exit(1)


def tasks_migrate(source: Path, target: Path) -> None:
    """Rewrite Terminal-Bench 1 tasks (task.yaml, run-tests.sh, solution.sh) in the Harbor layout.

    Usage: ``tslightning tasks migrate SOURCE TARGET``. SOURCE is one Terminal-Bench 1 task directory or a directory
    of them; each becomes TARGET/<name> with instruction.md, task.toml, environment/, tests/ (a test.sh that runs
    run-tests.sh and counts pytest's summary into the reward files) and solution/solve.sh. Nothing is overwritten;
    exits 2 naming the problem otherwise. Check the result with ``tslightning tasks validate TARGET``.

    Args:
        source: A Terminal-Bench 1 task directory, or a directory of them.
        target: Where the Harbor tasks are written (one directory per task, created).
    """
    try:
        migrations = migrate_tasks(source, target)
    except MigrationError as error:
        print(f"tasks migrate: {error}", file=sys.stderr)
        sys.exit(2)
    for migration in migrations:
        print(f"migrated {migration.source} -> {migration.target}")
        for note in migration.notes:
            print(f"  - {note}")


def tasks_toolchain(path: Path | None = None, cache_dir: Path | None = None) -> None:
    """Prepare the offline verifier toolchain: uv, the curl / apt-get shims, and the wheels the tasks' tests pin.

    Usage: ``tslightning tasks toolchain [DIR]``. Run it once on a machine with access to PyPI (the only download):
    afterwards the Terminal-Bench 2 template (``curl ... astral.sh/uv/.../install.sh | sh``, ``uvx -p 3.x -w
    pytest==X pytest``) runs offline in every attempt, unedited. Exits 2 naming the problem when uv is missing or
    pip cannot download a pin.

    Args:
        path: A task directory or a directory of them whose scripts' pins are cached (default: the shipped library).
        cache_dir: Where the toolchain lives (default: ``$TSLIGHTNING_CACHE_DIR``, ``$XDG_CACHE_HOME/tslightning``,
            ``/var/cache/tslightning`` for root, else ``~/.cache/tslightning``).
    """
    try:
        task_dirs = find_task_dirs(library_dir() if path is None else path)
        toolchain = prepare_toolchain(cache_dir)
        wheels = fill_wheel_cache(toolchain, requirements_of(task_dirs))
    except (FileNotFoundError, RuntimeError) as error:
        print(f"tasks toolchain: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"offline toolchain ready in {toolchain.root}: uv, curl and apt-get shims, {len(wheels)} wheels")
