"""How much attempt set-up's file work slows a learner thread in the same process: Python walks vs coreutils.

Set-up runs on threads beside the learner's. A Python copy (``shutil.copytree``) or ownership walk
(``file_tree.chown_tree``) makes system calls per file, each releasing and retaking the interpreter lock, so the
learner's small operators wait for the lock meanwhile; ``cp`` and ``chown`` in processes of their own do not. For a
directory tree (e.g. the ``corpus-workdir`` fixture's built working directory, 12,050 files), this times a copy and
a hand-over of ownership (the walk before each agent command when the trainer is root; the tree is already owned,
as from the second command on: repeated 20 times in one window) alone and beside a thread running small torch
operators (64x64 matmul + tanh, one intra-op thread), and prints that thread's rate during each.

Usage: .venv/bin/python scripts/measure_setup_interference.py --tree DIR [--work /dev/shm] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tslightning.sandbox.file_tree import chown_tree, remove_tree

NOBODY = 65534


def learner_rate(stop: threading.Event, rates: list[float]) -> None:
    """Iterations per second of 50 small operators each, until ``stop``."""
    x, count, start = torch.randn(64, 64), 0, time.perf_counter()
    while not stop.is_set():
        for _ in range(50):
            x = (x @ x).tanh()
        count += 1
    rates.append(count / (time.perf_counter() - start))


def timed(operation: Callable[[], None], beside_learner: bool) -> tuple[float, float | None]:
    """Seconds ``operation`` took, and the learner thread's rate meanwhile (``None`` when it ran alone)."""
    stop, rates = threading.Event(), []
    thread = threading.Thread(target=learner_rate, args=(stop, rates))
    if beside_learner:
        thread.start()
    start = time.perf_counter()
    operation()
    seconds = time.perf_counter() - start
    stop.set()
    if beside_learner:
        thread.join()
    return seconds, (rates[0] if rates else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True, help="a directory tree to copy, e.g. an image's workdir")
    parser.add_argument("--work", type=Path, default=Path("/dev/shm"), help="where the copies go")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"learner thread alone: {timed(lambda: time.sleep(3), True)[1]:.0f} it/s")
    work = Path(tempfile.mkdtemp(prefix="tsl-interference-", dir=args.work))
    target = work / "copy"
    hand_overs = 20
    operations: dict[str, Callable[[], None]] = {
        "copy   shutil.copytree": lambda: shutil.copytree(args.tree, target, symlinks=True),
        "copy   cp -R": lambda: subprocess.run(["cp", "-R", "-P", "--preserve=mode,timestamps", args.tree, target],
                                              check=True),
        "owner  chown_tree": lambda: [chown_tree(target, NOBODY, NOBODY) for _ in range(hand_overs)],
        "owner  chown -R": lambda: [subprocess.run(["chown", "-R", "-P", "-h", f"{NOBODY}:{NOBODY}", target],
                                                   check=True) for _ in range(hand_overs)],
    }  # fmt: skip
    try:
        for beside in (False, True):
            for name, operation in operations.items():
                runs = []
                for _ in range(args.repeats):
                    if name.startswith("owner"):
                        subprocess.run(["cp", "-R", "-P", args.tree, target], check=True)
                        chown_tree(target, NOBODY, NOBODY)
                    runs.append(timed(operation, beside))
                    remove_tree(target)
                per = hand_overs if name.startswith("owner") else 1
                seconds = sum(s for s, _ in runs) / len(runs) / per
                rate = f", learner {sum(r for _, r in runs) / len(runs):.0f} it/s" if beside else ""
                print(f"{name:<24}{'beside the learner' if beside else 'alone':<20}{seconds:.3f} s each{rate}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
