"""Step time and environment set-up of `tslightning fit` on image-lite tasks, environment prefetch off vs on.

Runs the same short ``fit`` (the quickstart's tiny policy, no warm start, GRPO, ``thundersync``, one wave of 8
one-turn attempts per update) on image-lite tasks whose attempt set-up takes about a second (default: the
``corpus-workdir`` fixture, whose image's 12,000-file working directory every attempt gets a private copy of), once
with ``rollout.prefetch_environments 0`` and once with it on, each in its own process, one after the other
(``--repeats``: alternating order, ABBA, which cancels a linear drift of the machine's speed). Per update it prints
the step wall time and the seconds the update's attempts waited for their environments
(``rollout/environment_wait_s``: set-up on the attempts' critical paths, summed over the attempts; set-ups run on
threads, several at once, so waits overlap and the sum can exceed the step), and over the updates after the first
(update 0 has nothing prefetched) the mean of each and what prefetch saved per update.

Needs the image-lite builder (root, mmdebstrap, bwrap); the image is built once into the cache directory.

Usage: .venv/bin/python benchmarks/measure_environment_prefetch.py [--updates 5] [--prefetch 8] [--repeats 1]
    [--tasks tests/fixtures/harbor_tasks/corpus-workdir] [--out runs/prefetch-measure]
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "harbor_tasks" / "corpus-workdir"


def fit_command(tasks: Path, updates: int, prefetch: int, out: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "tslightning.cli", "fit",
        "--config", str(ROOT / "configs" / "quickstart.yaml"),
        "--rollout.tasks", str(tasks), "--rollout.task_names", "null", "--rollout.split", "all",
        "--warm_start.steps", "0", "--updates", str(updates),
        "--rollout.prefetch_environments", str(prefetch),
        "--checkpoint.enabled", "false", "--progress", "false", "--overwrite", "true", "--out_dir", str(out),
        # one wave of 8 attempts (2 prompts x 4 samples, 8 in flight), one short turn each: set-up is the subject
        "--rollout.prompts_per_update", "2", "--rollout.samples_per_prompt", "4", "--rollout.max_turns", "1",
        "--rollout.max_tokens_per_turn", "32", "--rollout.max_tokens_per_trajectory", "32",
        *extra,
    ]  # fmt: skip


def per_update(out: Path) -> tuple[list[float], list[float]]:
    """Step seconds (``rewards.json``) and environment wait seconds (the CSV metrics) of each update of a run."""
    steps = json.loads((out / "rewards.json").read_text())["step_seconds"]
    waits: dict[int, float] = {}
    for metrics in sorted((out / "csv").glob("version_*/metrics.csv"))[-1:]:
        with metrics.open() as file:
            for row in csv.DictReader(file):
                if row.get("rollout/environment_wait_s"):
                    waits[int(float(row["step"]))] = float(row["rollout/environment_wait_s"])
    return steps, [waits[update] for update in sorted(waits)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=Path, default=CORPUS, help="a task directory or a directory of tasks")
    parser.add_argument("--updates", type=int, default=5)
    parser.add_argument("--prefetch", type=int, default=8, help="rollout.prefetch_environments of the 'on' runs")
    parser.add_argument("--repeats", type=int, default=1, help="off/on pairs, in alternating order")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "prefetch-measure")
    parser.add_argument("fit_args", nargs="*", help="further fit overrides, after --, e.g. -- --rollout.max_turns 2")
    args = parser.parse_args()
    runs: dict[int, list[tuple[list[float], list[float]]]] = {0: [], args.prefetch: []}
    for repeat in range(args.repeats):
        order = [0, args.prefetch] if repeat % 2 == 0 else [args.prefetch, 0]
        for prefetch in order:
            out = args.out / f"prefetch-{prefetch}-{repeat}"
            print(f"fit: prefetch_environments={prefetch} (repeat {repeat}) -> {out}", flush=True)
            command = fit_command(args.tasks, args.updates, prefetch, out, args.fit_args)
            subprocess.run(command, check=True, cwd=ROOT)
            runs[prefetch].append(per_update(out))
            shutil.rmtree(out / "policy", ignore_errors=True)
    report(runs, args.prefetch)


def report(runs: dict[int, list[tuple[list[float], list[float]]]], prefetch: int) -> None:
    print(f"\n{'run':<14}{'update':>7}{'step s':>9}{'env wait s':>12}")
    for setting, repeats in runs.items():
        for repeat, (steps, waits) in enumerate(repeats):
            for update, (step, wait) in enumerate(zip(steps, waits, strict=True)):
                print(f"{f'prefetch={setting}/{repeat}':<14}{update:>7}{step:>9.2f}{wait:>12.2f}")
    mean = {s: [statistics.mean(x for steps, waits in r for x in (steps[1:] if i == 0 else waits[1:])) for i in (0, 1)]
            for s, r in runs.items()}  # fmt: skip
    (off_step, off_wait), (on_step, on_wait) = mean[0], mean[prefetch]
    print(f"\nupdates 1..: mean step {off_step:.2f} s off, {on_step:.2f} s on: {off_step - on_step:+.2f} s per update")
    print(f"             environment wait (summed over attempts; waits at once overlap) {off_wait:.2f} s off, "
          f"{on_wait:.2f} s on")  # fmt: skip
    print("             (update 0 has nothing prefetched in either run: compare it to see the machine's drift)")


if __name__ == "__main__":
    main()
