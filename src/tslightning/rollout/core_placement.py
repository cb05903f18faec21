"""CPU cores for rollout-side work: the ``hf`` replicas, the agent loop's threads and the OPD teacher's scoring thread
run on the cores named for them, away from the learner's (as separate GPUs would be).

Linux affinity is per thread: :func:`place_this_thread` moves only the calling thread, and threads it starts later
inherit its cores.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def check_cores(owner: str, cpus: Sequence[int] | None) -> None:
    """Raise ``ValueError`` naming ``owner`` unless ``cpus`` is ``None`` or a non-empty list of this machine's cores."""
    available = os.cpu_count() or 1
    if cpus is not None and (not cpus or not set(cpus) <= set(range(available))):
        raise ValueError(f"{owner}: cpus {list(cpus)} must be a non-empty list of cores in 0..{available - 1}")


def place_this_thread(cpus: Sequence[int]) -> None:
    """Run the calling thread (and threads it starts afterwards) on ``cpus`` only."""
    os.sched_setaffinity(0, cpus)  # 0: the calling thread
