"""How much attempt set-up's file work slows a learner thread in the same process: Python walks vs coreutils.

Set-up runs on threads beside the learner's. A Python copy (``shutil.copytree``) or ownership walk
(``file_tree.chown_tree``) makes system calls per file, each releasing and retaking the interpreter lock, so the
learner's small operators wait for the lock meanwhile; ``cp`` and ``chown`` in processes of their own do not. For a
directory tree (e.g. the ``corpus-workdir`` fixture's built working directory, 12,050 files), this times a copy and
a hand-over of ownership (the walk before each agent command when the trainer is root; the tree is already owned,
as from the second command on: repeated 20 times in one window), and 20 agent commands in a live environment on a
copy of the tree (bubblewrap, when installed), with the hand-over walk before each (as before 2026-12-05) and only
when the trainer wrote into the attempt (now), alone and beside a thread running small torch operators (64x64
matmul + tanh, one intra-op thread), and prints that thread's rate during each.

Usage: .venv/bin/python benchmarks/measure_setup_interference.py --tree DIR [--work /dev/shm] [--repeats 3]
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

from tslightning.sandbox import AttemptDirectory, SandboxLimits, make_sandbox
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


def agent_commands(sandbox, count: int, walk_each: bool) -> None:
    """``count`` agent commands (``true``) in the live ``sandbox``, each after a hand-over walk (``walk_each``: the
    trainer says it wrote before each, as every command walked before) or with none (nothing written since)."""
    for _ in range(count):
        if walk_each:
            sandbox.attempt.wrote_from_host()
        assert sandbox.run("true").ok


def timed_in_live_environment(tree: Path, work: Path, operation, beside_learner: bool, live: list):
    """:func:`timed` ``operation`` on a live environment (set up and started before, closed after) whose ``/app``
    is a copy of ``tree``, handed to ``live[0]``."""
    with AttemptDirectory(tree, parent=str(work)) as attempt:
        sandbox = make_sandbox("bubblewrap", attempt=attempt, limits=SandboxLimits(timeout_s=30), live=True)
        try:
            assert sandbox.run("true").ok  # started, and handed over once
            live[:] = [sandbox]
            return timed(operation, beside_learner)
        finally:
            sandbox.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True, help="a directory tree to copy, e.g. an image's workdir")
    parser.add_argument("--work", type=Path, default=Path("/dev/shm"), help="where the copies go")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"learner thread alone: {timed(lambda: time.sleep(3), True)[1]:.0f} it/s")
    work = Path(tempfile.mkdtemp(prefix="tsl-interference-", dir=args.work))
    work.chmod(0o755)  # the live environment's unprivileged uid goes through it to its attempt
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
    live = []  # the live environment of the "agent" rows, on a copy of the tree
    if shutil.which("bwrap"):
        operations["agent  command, walk each"] = lambda: agent_commands(live[0], hand_overs, walk_each=True)
        operations["agent  command, walk when written"] = lambda: agent_commands(live[0], hand_overs, False)
    try:
        for beside in (False, True):
            for name, operation in operations.items():
                runs = []
                for _ in range(args.repeats):
                    if name.startswith("owner"):
                        subprocess.run(["cp", "-R", "-P", args.tree, target], check=True)
                        chown_tree(target, NOBODY, NOBODY)
                    if name.startswith("agent"):
                        runs.append(timed_in_live_environment(args.tree, work, operation, beside, live))
                        continue
                    runs.append(timed(operation, beside))
                    remove_tree(target)
                per = hand_overs if name.startswith(("owner", "agent")) else 1
                seconds = sum(s for s, _ in runs) / len(runs) / per
                rate = f", learner {sum(r for _, r in runs) / len(runs):.0f} it/s" if beside else ""
                print(f"{name:<34}{'beside the learner' if beside else 'alone':<20}{seconds:.3f} s each{rate}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
