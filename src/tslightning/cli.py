"""The ``tslightning`` command line: jsonargparse subcommands derived from typed signatures (LitGPT style)."""

from __future__ import annotations

import json as json_module
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from jsonargparse import CLI

from tslightning.sandbox import Backend, SandboxUnavailableError
from tslightning.tasks.rewards import RewardScheme
from tslightning.tasks.validation import format_table, sandbox_factory, validate_tasks
from tslightning.verification import DTypeName
from tslightning.verification import verify as run_verification

_BARE_FLAGS = ("--json",)


def verify(
    objective: Literal["grpo", "opd"] = "grpo",
    dtype: DTypeName = "float64",
    updates: int = 3,
    seed: int = 0,
    json: bool = False,
) -> None:
    """Prove the streamed update equals the batch-synchronous one on the tiny transformer (App. G protocol).

    Builds the tiny Qwen2 model offline, makes ``updates`` logical batches (several groups, multi-turn
    trajectories, varied lengths, a uniform-reward group), replays each under sync and under streaming in a
    shuffled arrival order from the same θ_0, and reports the first direction's relative error and cosine and
    the parameter gap after each update beside the bf16-vs-fp32 reference gap. Exits 1 when the relative error
    exceeds the dtype's tolerance (1e-10 for float64, 1e-5 for float32).

    Args:
        objective: ``grpo`` (Eqs. 4-7) or ``opd`` (Eqs. 8-9).
        dtype: Precision of the two compared runs.
        updates: Logical batches (optimizer updates) to replay.
        seed: Seed of the model, the batches and the arrival orders.
        json: Print the report as JSON instead of text.
    """
    report = run_verification(objective=objective, dtype=dtype, updates=updates, seed=seed)
    print(json_module.dumps(report.to_dict(), indent=2) if json else report.summary())
    if not report.passed:
        sys.exit(1)


def tasks_validate(
    path: Path | None = None,
    backend: Backend = "bubblewrap",
    scheme: RewardScheme = "seta",
    workers: int = 2,
) -> None:
    """Check terminal tasks: the reference solution passes and the no-op agent does not (App. C.2).

    Usage: ``tslightning tasks validate [DIR]``. For each task, two fresh sandbox attempts: one where the agent does
    nothing, one that runs ``solution/solve.sh``; the verifier scores both. Prints a table and exits 1 naming each
    task whose reference does not fully pass or whose no-op already passes (with the verifier output's tail).

    Args:
        path: A task directory or a directory of task directories (default: the shipped library).
        backend: Sandbox backend of the attempts.
        scheme: Reward scheme of the reported rewards (``seta``: p + 0.5·1[p = 1]; ``binary``).
        workers: Tasks validated at once.
    """
    try:
        results = validate_tasks(path, scheme=scheme, workers=workers, make_attempt_sandbox=sandbox_factory(backend))
    except (FileNotFoundError, SandboxUnavailableError) as error:
        print(f"tasks validate: {error}", file=sys.stderr)
        sys.exit(2)
    print(format_table(results))
    failed = [result.task for result in results if not result.ok]
    if failed:
        print(f"tasks validate: {len(failed)} invalid task(s): {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``tslightning`` console script."""
    args = _positional_task_dir(list(sys.argv[1:] if argv is None else argv))
    from tslightning.fit import fit  # imported here: it pulls in the rollout engines and callbacks

    commands = {"fit": fit, "verify": verify, "tasks": {"validate": tasks_validate}}
    CLI(commands, args=_expand_bare_flags(args), as_positional=False)


def _positional_task_dir(args: list[str]) -> list[str]:
    """Let ``tasks validate DIR`` name its directory positionally as well as with ``--path DIR``."""
    if args[:2] == ["tasks", "validate"] and len(args) > 2 and not args[2].startswith("-"):
        return [*args[:2], "--path", *args[2:]]
    return args


def _expand_bare_flags(args: list[str]) -> list[str]:
    """Let boolean switches be given bare (``--json``) as well as ``--json true``."""
    expanded = []
    for position, arg in enumerate(args):
        expanded.append(arg)
        following = args[position + 1] if position + 1 < len(args) else None
        if arg in _BARE_FLAGS and (following is None or following.startswith("--")):
            expanded.append("true")
    return expanded


if __name__ == "__main__":
    main()
