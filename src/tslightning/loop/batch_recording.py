"""Recording each rank's logical batches as the learner received them, for an offline replay (App. G protocol).

``fit --record_batches true`` saves, per learner rank and update, the stream items in the order the rank ingested
them — its :class:`~tslightning.core.batch_registry.BatchPlan`, its sources (token ids, masks, rewards or teacher
log-probs, policy versions) and the completion events — as ``<out_dir>/batches/rank<r>-update<k>.pt``
(``torch.save`` of a list). Replaying the union of every rank's items with the batch-synchronous learner from the
same θ_k gives the update the run took (tests/distributed check this across ranks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed, StreamItem


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


def load_batches(directory: Path, update: int) -> dict[int, list[BatchPlan | StreamItem]]:
    """Every rank's recorded items of update ``update``, by rank."""
    files = sorted(directory.glob(f"rank*-update{update}.pt"))
    if not files:
        raise FileNotFoundError(f"{directory} holds no recorded batch of update {update} (fit --record_batches true)")
    return {int(f.name.split("-")[0].removeprefix("rank")): torch.load(f, weights_only=False) for f in files}
