"""BatchBarrier: the step happens only for a complete logical batch served at the learner's policy version."""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from tslightning.callbacks import BatchBarrier
from tslightning.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch
from tslightning.sources import PolicyVersionError, SourceError
from tslightning.streaming_module import StreamingPolicyModule

SMALL = WorkloadShape(
    num_groups=2, group_size=3, max_turns=2, prompt_tokens=(3, 6), action_tokens=(2, 4), observation_tokens=(2, 4)
)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def grpo_batch(vocab_size: int, version: int = 0) -> ReplayBatch:
    return synthetic_grpo_batch(vocab_size, version, torch.Generator().manual_seed(version), SMALL)


def fabric_barrier(fabric: L.Fabric, module, optimizer) -> None:
    """Our Fabric loop's barrier (hooks called with keywords: the set-up module is a Fabric callback too)."""
    module.barrier(
        optimizer,
        before_step=lambda: fabric.call(
            "on_before_optimizer_step", trainer=fabric, pl_module=module, optimizer=optimizer
        ),
    )


def test_trainer_passes_one_barrier_per_update(make_policy, vocab_size, tmp_path):
    barrier, module = BatchBarrier(), StreamingPolicyModule(make_policy())
    items = [*grpo_batch(vocab_size, 0).stream(), *grpo_batch(vocab_size, 1).stream()]
    L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        callbacks=[barrier],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    ).fit(module, train_dataloaders=DataLoader(items, batch_size=None))
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
