"""fit --record_batches: each rank's items of an update saved as the batch closes, read back by update."""

from __future__ import annotations

import pytest

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import BatchClosed, GroupClosed
from tslightning.loop.batch_recording import batch_file, load_batches, recorded


def test_items_are_saved_when_the_batch_closes_even_if_nobody_asks_further(tmp_path):
    plan = BatchPlan(Objective.GRPO, 0, {"g": 1})
    items = [plan, GroupClosed("g"), BatchClosed(0), "never reached"]
    stream = recorded(iter(items), batch_file(tmp_path, 1, 0))
    taken = []
    for item in stream:  # the loop stops at BatchClosed, as one_update does
        taken.append(item)
        if isinstance(item, BatchClosed):
            break
    assert taken == items[:3]
    assert load_batches(tmp_path, 0) == {1: items[:3]}
    with pytest.raises(FileNotFoundError, match="no recorded batch of update 1"):
        load_batches(tmp_path, 1)


def test_nothing_is_written_without_a_path(tmp_path):
    assert list(recorded(iter([BatchClosed(0)]), None)) == [BatchClosed(0)]
    assert not any(tmp_path.iterdir())
