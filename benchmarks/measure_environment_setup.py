"""Set-up and tear-down of image-lite attempt environments, round after round, outside ``fit``.

Opens ``--attempts`` environments of a task per round (default: the ``corpus-workdir`` fixture, whose image's
12,000-file working directory every attempt copies) through the attempt factory ``fit`` uses
(:func:`tslightning.loop.startup.attempt_factory`), runs one command and the verifier in each (as a one-turn
attempt does), closes them, and repeats for ``--rounds``. ``--parallel N`` sets up and closes N at a time on threads
(as the rollout does), 1 one after the other. Per round it prints the mean set-up, command + verify and close
seconds of an attempt, and what the round left behind: processes of the sandbox's uid, ``tsl-attempt-*``
directories, the kernel's dentry count, dirty + writeback memory. A set-up that grows round after round here is in
the environment code; one that grows only inside ``fit`` is not.

Needs the image-lite builder (root, mmdebstrap, bwrap); the image is built once into the cache directory.

Usage: TSLIGHTNING_CACHE_DIR=... PYTHONPATH=src .venv/bin/python benchmarks/measure_environment_setup.py
    [--rounds 4] [--attempts 8] [--parallel 1] [--tasks tests/fixtures/harbor_tasks/corpus-workdir]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tslightning.loop.settings import RolloutSettings
from tslightning.loop.startup import attempt_factory
from tslightning.sandbox.bubblewrap import DEFAULT_UNPRIVILEGED_UID
from tslightning.tasks.terminal_task import TerminalTask

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fixtures" / "harbor_tasks" / "corpus-workdir"


def one_attempt(factory, task) -> tuple[float, float, float]:
    """Seconds of set-up, one command + the verifier, and close of one attempt."""
    start = time.perf_counter()
    attempt = factory(task)
    opened = time.perf_counter()
    try:
        attempt.run_command("ls > /dev/null")
        attempt.verify()
    finally:
        ran = time.perf_counter()
        attempt.close()
    return opened - start, ran - opened, time.perf_counter() - ran


def leftovers(uid: int) -> dict[str, int]:
    """What the machine holds now: processes of ``uid``, attempt directories, dentries, dirty + writeback KiB."""
    processes = sum(1 for status in Path("/proc").glob("[0-9]*/status") if _uid_of(status) == uid)
    temp = Path(tempfile.gettempdir())
    directories = len([*temp.glob("tsl-attempt-*"), *temp.glob("tsl-attempts-*/tsl-attempt-*")])
    dentries = int(Path("/proc/sys/fs/dentry-state").read_text().split()[0])
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    dirty = sum(int(meminfo[key].split()[0]) for key in ("Dirty", "Writeback"))
    return {"processes": processes, "attempt_dirs": directories, "dentries": dentries, "dirty_kib": dirty}


def _uid_of(status: Path) -> int | None:
    try:
        for line in status.read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=Path, default=CORPUS, help="a task directory")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--parallel", type=int, default=1, help="attempts set up and closed at once")
    args = parser.parse_args()
    task = TerminalTask.load(args.tasks)
    factory = attempt_factory(RolloutSettings(environment="terminal"))
    print(f"before: {leftovers(DEFAULT_UNPRIVILEGED_UID)}", flush=True)
    print(f"{'round':>5}{'wall s':>9}{'set-up s':>10}{'run s':>8}{'close s':>9}  left behind after the round")
    with ThreadPoolExecutor(args.parallel) as pool:
        for round_index in range(args.rounds):
            start = time.perf_counter()
            times = list(pool.map(lambda _: one_attempt(factory, task), range(args.attempts)))
            wall = time.perf_counter() - start
            setup, run, close = (statistics.mean(column) for column in zip(*times, strict=True))
            left = leftovers(DEFAULT_UNPRIVILEGED_UID)
            print(f"{round_index:>5}{wall:>9.2f}{setup:>10.2f}{run:>8.2f}{close:>9.2f}  {left}", flush=True)


if __name__ == "__main__":
    main()
