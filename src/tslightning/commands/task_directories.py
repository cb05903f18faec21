"""``tslightning tasks``: check task directories (``validate``) and rewrite Terminal-Bench 1 ones (``migrate``)."""

from __future__ import annotations

import sys
from pathlib import Path

from tslightning.sandbox import Backend, SandboxUnavailableError
from tslightning.tasks.migration import MigrationError, migrate_tasks
from tslightning.tasks.rewards import RewardScheme
from tslightning.tasks.validation import format_table, sandbox_factory, validate_tasks


def tasks_validate(
    path: Path | None = None,
    backend: Backend = "bubblewrap",
    scheme: RewardScheme = "seta",
    workers: int = 2,
    reward_key: str = "reward",
) -> None:
    """Check terminal tasks: the reference solution passes and the no-op agent does not (App. C.2).

    Usage: ``tslightning tasks validate [DIR]``. For each task, two fresh sandbox attempts: one where the agent does
    nothing, one that runs ``solution/solve.sh``; the verifier scores both. Prints a table (each task's status:
    valid, invalid, needs image, needs network at build, needs helper container; build and set-up seconds) and exits
    1 naming each task whose reference does not fully pass or whose no-op already passes (with the verifier output's
    tail), and each task whose environment cannot be provided here (with the reason; no attempt is run).

    Args:
        path: A task directory or a directory of task directories (default: the shipped library).
        backend: Sandbox backend of the attempts.
        scheme: Reward scheme of the reported rewards (``seta``: p + 0.5·1[p = 1]; ``binary``).
        workers: Tasks validated at once.
        reward_key: The named reward of a verifier's ``reward.json`` read as the pass fraction.
    """
    try:
        results = validate_tasks(
            path, scheme=scheme, workers=workers, make_attempt_sandbox=sandbox_factory(backend), reward_key=reward_key
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
