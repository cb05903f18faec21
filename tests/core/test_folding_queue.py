"""Folds off the learner thread: in submission order, bounded, errors surfaced, and the update bitwise unchanged."""

from __future__ import annotations

import threading

import pytest
import torch

from tslightning.core.folding_queue import FoldingQueue
from tslightning.core.replay_batches import WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.learner.streaming_module import StreamingPolicyModule


def test_folds_run_in_order_on_one_background_thread():
    queue = FoldingQueue(depth=2)
    seen = []
    for index in range(20):
        queue.submit(lambda index=index: seen.append((index, threading.current_thread().name)))
    queue.drain()
    assert [index for index, _ in seen] == list(range(20)) and queue.folded == 20
    assert {name for _, name in seen} != {threading.current_thread().name}
    assert len({name for _, name in seen}) == 1
    queue.close()


def test_submit_blocks_while_depth_folds_are_pending():
    queue = FoldingQueue(depth=1)
    release = threading.Event()
    queue.submit(release.wait)  # occupies the only slot until released
    second = threading.Thread(target=lambda: queue.submit(lambda: None))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive()  # bounded: the second fold waits for the first
    release.set()
    second.join(timeout=10)
    assert not second.is_alive()
    queue.close()
    assert queue.folded == 2


def test_a_failed_fold_is_raised_at_the_next_drain_and_later_folds_still_run():
    queue = FoldingQueue(depth=3)
    seen = []

    def fail() -> None:
        raise RuntimeError("fold failed")

    release = threading.Event()
    queue.submit(release.wait)  # holds the next two back, so neither has failed when they are submitted
    queue.submit(fail)
    queue.submit(lambda: seen.append(1))
    release.set()
    with pytest.raises(RuntimeError, match="fold failed"):
        queue.drain()
    assert seen == [1]
    queue.drain()  # reported once
    queue.submit(fail)
    queue.discard()  # a reset drops it
    queue.submit(fail)
    with pytest.raises(RuntimeError, match="fold failed"):
        queue.close()


@pytest.mark.parametrize("depth", [0, "bad", True])
def test_depth_must_be_a_positive_int(depth):
    with pytest.raises(ValueError, match="fold_queue_depth must be an int >= 1"):
        FoldingQueue(depth)


def _update(policy, batch, **kwargs) -> tuple[torch.Tensor, StreamingPolicyModule]:
    module = StreamingPolicyModule(policy, objective=batch.plan.objective, group_admission_cap=2, **kwargs)
    optimizer = module.configure_optimizers()
    for item in batch.stream():
        module.ingest(item)
    module.barrier(optimizer)
    return module.last_direction, module


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_background_folding_gives_the_same_update_bit_for_bit(make_policy, teacher64, vocab_size, objective):
    shape = WorkloadShape(num_groups=4, group_size=3)
    generator = torch.Generator().manual_seed(5)
    if objective == "grpo":
        batch = synthetic_grpo_batch(vocab_size, 0, generator, shape)
    else:
        batch = synthetic_opd_batch(vocab_size, 0, generator, teacher64, shape)
    batch = batch.reordered(torch.Generator().manual_seed(6))
    inline, _ = _update(make_policy(), batch)
    background, module = _update(make_policy(), batch, fold_queue_depth=2)
    assert inline.abs().sum() > 0 and torch.equal(background, inline)
    units = len(module.layout.units)  # every unit of every source's backward is one fold
    assert (
        module.folding.folded == batch.plan.num_prompts * 3 * units
        if objective == "grpo"
        else module.folding.folded > 0
    )
    assert module.last_update.peak_held_numel <= 5 * module.layout.numel  # the cap still bounds the statistics
