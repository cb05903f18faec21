"""BatchBarrier: the step happens only for a complete logical batch served at the learner's policy version."""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import pytest
import torch
from harness import fabric_barrier, fit, grpo_batch, grpo_batches

from tslightning.callbacks import BatchBarrier
from tslightning.core.sources import PolicyVersionError, SourceError
from tslightning.learner.streaming_module import StreamingPolicyModule


def test_trainer_passes_one_barrier_per_update(make_policy, vocab_size, tmp_path):
    barrier, module = BatchBarrier(), StreamingPolicyModule(make_policy())
    fit(module, grpo_batches(vocab_size, 2), [barrier], tmp_path)
    assert module.policy_version == 2 and barrier.barriers_passed == 2
    restored = BatchBarrier()
    restored.load_state_dict(barrier.state_dict())
    assert restored.state_dict() == barrier.state_dict() == {"barriers_passed": 2}


def test_fabric_passes_one_barrier_per_update(make_policy, vocab_size):
    barrier = BatchBarrier()
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[barrier])
    module = StreamingPolicyModule(make_policy())
    wrapped, optimizer = fabric.setup(module, module.configure_optimizers())
    for version in range(2):
        for item in grpo_batch(vocab_size, version).stream():
            wrapped.ingest(item)
        fabric_barrier(fabric, wrapped, optimizer)
    assert module.policy_version == 2 and barrier.barriers_passed == 2


def test_incomplete_batch_is_refused(make_policy, vocab_size):
    module, barrier = StreamingPolicyModule(make_policy()), BatchBarrier()
    fabric, optimizer = L.Fabric(accelerator="cpu", devices=1), module.configure_optimizers()

    def check() -> None:
        barrier.on_before_optimizer_step(fabric, module, optimizer)

    with pytest.raises(SourceError, match="policy version 0 with no logical batch open"):
        check()
    batch = grpo_batch(vocab_size)
    module.ingest(batch.plan)
    for item in batch.items[:2]:  # two sources of group-0
        module.ingest(item)
    with pytest.raises(SourceError, match=r"2 registered group\(s\) still open \(group-0, group-1\) and BatchClosed"):
        check()
    for item in batch.items[2:-1]:  # every group closed, BatchClosed not yet
        module.ingest(item)
    with pytest.raises(SourceError, match="reached with BatchClosed has not arrived"):
        check()
    assert barrier.barriers_passed == 0
    module.ingest(batch.items[-1])
    check()
    assert barrier.barriers_passed == 1


def test_source_served_at_another_version_stops_the_step(make_policy, vocab_size):
    barrier = BatchBarrier()
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[barrier])
    module = StreamingPolicyModule(make_policy())
    wrapped, optimizer = fabric.setup(module, module.configure_optimizers())
    theta0 = module.layout.values()
    for item in grpo_batch(vocab_size).stream():
        wrapped.ingest(item)
    # The service trace says group-1's first source was sampled by θ_1.
    first = next(i for i, record in enumerate(module.service_log) if record.group_id == "group-1")
    module.service_log[first] = replace(module.service_log[first], policy_version=1)
    with pytest.raises(
        PolicyVersionError, match=r"1 source\(s\) served for update 0 .*\('group-1', trajectory \d\) at version 1"
    ):
        fabric_barrier(fabric, wrapped, optimizer)
    assert torch.equal(module.layout.values(), theta0)
    assert module.policy_version == 0 and barrier.barriers_passed == 0
    BatchBarrier(zero_staleness=False).on_before_optimizer_step(fabric, module, optimizer)  # lag is another's job
