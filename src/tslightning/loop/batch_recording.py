"""Recording each rank's logical batches as the learner received them, for an offline replay (App. G protocol).

``fit --record_batches true`` saves, per learner rank and update, the stream items in the order the rank ingested
them — its :class:`~tslightning.core.batch_registry.BatchPlan`, its sources (token ids, masks, rewards or teacher
log-probs, policy versions) and the completion events — as ``<out_dir>/batches/rank<r>-update<k>.pt``
(``torch.save`` of a list; :func:`read_batch` reads one back with torch's weights-only unpickler). Replaying the
union of every rank's items with the batch-synchronous learner from the same θ_k gives the update the run took
(tests/distributed check this across ranks); ``fit --replay_batches`` replays each rank's own items
(:mod:`tslightning.loop.batch_replay`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import (
    BatchClosed,
    GroupClosed,
    StreamItem,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)

RECORDED_TYPES = (BatchPlan, Objective, TrajectorySource, TurnSource, TrajectoryClosed, GroupClosed, BatchClosed)
"""What a recorded file may hold besides tensors and plain containers."""


def batch_file(directory: Path, rank: int, update: int) -> Path:
    """Where rank ``rank``'s items of update ``update`` are saved."""
    return directory / f"rank{rank}-update{update}.pt"


def recorded(items: Iterable[BatchPlan | StreamItem], path: Path | None) -> Iterator[BatchPlan | StreamItem]:
    """Yield ``items`` unchanged, saving them all to ``path`` as the batch closes (``None``: record nothing).

    The loop stops asking at :class:`~tslightning.core.sources.BatchClosed`, so the file is written before that item
    is handed over, not when the iterator is exhausted.
    """
    if path is None:
        yield from items
        return
    seen = []
    for item in items:
        seen.append(item)
        if isinstance(item, BatchClosed):
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(seen, path)
        yield item


def read_batch(path: Path) -> list[BatchPlan | StreamItem]:
    """One recorded file's items, read by torch's weights-only unpickler that builds only :data:`RECORDED_TYPES`
    (a file from elsewhere cannot run code; its items are checked again as the learner ingests them)."""
    with torch.serialization.safe_globals(list(RECORDED_TYPES)):
        return torch.load(path, weights_only=True)


def load_batches(directory: Path, update: int) -> dict[int, list[BatchPlan | StreamItem]]:
    """Every rank's recorded items of update ``update``, by rank."""
    files = sorted(directory.glob(f"rank*-update{update}.pt"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no recorded batch of update {update} (fit --record_batches true)")
    return {int(f.name.split("-")[0].removeprefix("rank")): read_batch(f) for f in files}
