"""`tslightning validate --checkpoint RUN`: a fit run's final policy beside its initial policy (``policy-0``, after
the warm start, before RL), on the train and the dev side of the group split, with the run's own tasks and agent
limits — so what RL changed is one table.

Each cell is :func:`~tslightning.commands.evaluation.validate` (App. E.2's pass@k on fresh sandboxed attempts): the
train side is the run's training tasks (``rollout.task_names`` of its split), the dev side every held-out task of
``rollout.tasks``. Beside pass@k the table gives the mean fraction of verifier tests passed, which moves before full
passes do.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tslightning.commands.evaluation import resolve_checkpoint, validate

LIMITS = ("max_turns", "max_tokens_per_turn", "max_tokens_per_trajectory")
LIMITS += ("observation_head_tokens", "observation_tail_tokens", "max_concurrent_attempts")
"""Agent limits a comparison takes from the run's ``rollout`` settings (training and evaluation share them)."""


@dataclass(frozen=True)
class FitRun:
    """A ``fit`` output directory: its resolved config, its initial policy and the checkpoint to compare with it."""

    out_dir: Path
    config: dict[str, Any]
    initial: Path
    final: Path


def fit_run(checkpoint: str | Path) -> FitRun | None:
    """The fit run ``checkpoint`` names — its ``out_dir``, or one of its ``update-<k>`` checkpoints — when that run
    has a ``config.yaml`` and a ``policy-0/``; ``None`` for anything else (a bare policy directory)."""
    path = Path(checkpoint)
    for out_dir in (path, path.parent.parent):
        if (out_dir / "config.yaml").is_file() and (out_dir / "policy-0" / "config.json").is_file():
            final = resolve_checkpoint(path)
            if final.resolve() == (out_dir / "policy-0").resolve():
                return None  # nothing trained yet: no checkpoint beside policy-0
            config = yaml.safe_load((out_dir / "config.yaml").read_text()) or {}
            return FitRun(out_dir, config, out_dir / "policy-0", final)
    return None


@functools.wraps(validate)  # its signature and docstring: the command's options are validate's
def validate_or_compare(**options: Any) -> dict:
    """``tslightning validate``: with no ``split`` on a ``fit`` run (its directory or one of its checkpoints),
    :func:`compare_policies` with the run's tasks and limits; else :func:`~tslightning.commands.evaluation.validate`
    (``split`` ``None`` meaning ``dev``). Takes ``validate``'s arguments."""
    run = fit_run(options["checkpoint"]) if options.get("split") is None else None
    if run is None:
        return validate(**options)
    compared = {key: options[key] for key in _COMPARED if key in options}
    return compare_policies(run, **compared)


_COMPARED = ("attempts", "k", "engine", "seed", "replicas", "dtype", "backend", "out")
"""``validate`` arguments a comparison passes on (tasks, split and limits come from the run's config)."""


def compare_policies(
    run: FitRun,
    splits: Sequence[str] = ("train", "dev"),
    attempts: int = 3,
    k: Sequence[int] = (1, 3),
    out: str | None = None,
    **options: Any,
) -> dict:
    """Evaluate ``run``'s policy-0 and its final policy on each of ``splits``; ``options`` go to ``validate``
    (engine, seed, dtype, backend, ...). Returns ``{"run": ..., "rows": [...]}``, one row per split and policy, each
    with the split, the policy's label and path, the task count, pass@k and the mean passed fraction."""
    rollout = run.config.get("rollout") or {}
    limits = {name: rollout[name] for name in LIMITS if rollout.get(name) is not None}
    rows = []
    for split in splits:
        names = rollout.get("task_names") if split == rollout.get("split", "train") else None
        for label, policy in (("policy-0", run.initial), (run.final.name, run.final)):
            report = validate(
                str(policy),
                tasks=rollout.get("tasks"),
                task_names=names,
                split=split,
                dev_fraction=rollout.get("dev_fraction", 0.2),
                attempts=attempts,
                k=k,
                **(limits | options),
            )
            rows.append(_row(split, label, policy, report))
    comparison = {"run": str(run.out_dir), "attempts": attempts, "rows": rows}
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(comparison, indent=2) + "\n")
    return comparison


def format_comparison(comparison: dict) -> str:
    """A fixed-width table: per split and policy, the task count, pass@k (in %) and the mean passed fraction."""
    rows = comparison["rows"]
    names = list(rows[0]["pass_at_k"]) if rows else []
    width = max([len("policy"), *(len(row["policy"]) for row in rows)])
    header = f"{'split':<5}  {'tasks':>5}  {'policy':<{width}}" + "".join(f"  {n:>8}" for n in names) + "  tests passed"
    lines = [
        f"tslightning validate: {comparison['run']}: policy-0 (before RL) against the final policy, "
        f"{comparison['attempts']} attempts per task",
        header,
        "-" * len(header),
    ]
    for row in rows:
        scores = "".join(f"  {100 * row['pass_at_k'][n]:>7.1f}%" for n in names)
        passed = f"{100 * row['mean_passed_fraction']:>11.1f}%"
        lines.append(f"{row['split']:<5}  {row['tasks']:>5}  {row['policy']:<{width}}{scores}  {passed}")
    return "\n".join(lines)


def _row(split: str, label: str, policy: Path, report: dict) -> dict:
    return {
        "split": split,
        "policy": label,
        "path": str(policy),
        "tasks": len(report["tasks"]),
        "pass_at_k": report["pass_at_k"],
        "mean_passed_fraction": report["mean_passed_fraction"],
        "per_task": report["tasks"],
    }
