"""One update per Trainer batch: a lazy update stream is stamped after the previous publication, its order is
checked, and the streaming module's hooks (Fabric's on_before_optimizer_step, checkpoints) do their part."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from tslightning.core.replay_batches import WorkloadShape, synthetic_grpo_batch
from tslightning.core.sources import SourceError
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.learner.update_stream import update_backlogs

SHAPE = WorkloadShape(num_groups=2, group_size=2, max_turns=1, prompt_tokens=(3, 5), action_tokens=(2, 3))


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class LiveUpdates(IterableDataset):
    """Like a rollout datamodule: each update's stream is a generator that stamps its BatchPlan with the version the
    module holds when the stream is first iterated (the engine's version, after the previous publication)."""

    def __init__(self, module: StreamingPolicyModule, vocab_size: int, updates: int) -> None:
        self.module, self.vocab_size, self.updates = module, vocab_size, updates
        self.stamped: list[int] = []

    def stream(self, update: int):
        version = self.module.policy_version  # runs only when the learner starts this update
        self.stamped.append(version)
        yield from synthetic_grpo_batch(self.vocab_size, version, torch.Generator().manual_seed(update), SHAPE).stream()

    def __iter__(self):
        for update in range(self.updates):
            yield self.stream(update)


def _trainer(tmp_path, **args) -> L.Trainer:
    settings = dict(
        max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    return L.Trainer(**(settings | args))


def test_a_lazy_update_per_batch_is_stamped_after_the_previous_step(make_policy, vocab_size, tmp_path):
    """The DataLoader prefetches the next batch — a generator not yet started — so nothing is sampled early."""
    module = StreamingPolicyModule(make_policy())
    data = LiveUpdates(module, vocab_size, 3)
    trainer = _trainer(tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=None, collate_fn=lambda update: update))
    assert data.stamped == [0, 1, 2] and module.policy_version == 3
    assert trainer.global_step == 3  # the Trainer's step counts updates


def test_the_update_stream_is_checked_in_order():
    batch = synthetic_grpo_batch(64, 0, torch.Generator().manual_seed(0), SHAPE)
    items = list(batch.stream())
    assert [item for ready in update_backlogs(items, under_trainer=True) for item in ready] == items
    with pytest.raises(SourceError, match="an update's stream starts with its BatchPlan"):
        list(update_backlogs(items[1:], under_trainer=True))
    with pytest.raises(SourceError, match="ended before its BatchClosed"):
        list(update_backlogs(items[:-1], under_trainer=True))
    with pytest.raises(SourceError, match="continues after BatchClosed with a BatchPlan; one batch holds exactly one"):
        list(update_backlogs(items + [items[0]], under_trainer=True))
    with pytest.raises(SourceError, match="training_step got a int"):
        list(update_backlogs(3, under_trainer=False))
    assert list(update_backlogs(items[0], under_trainer=False)) == [[items[0]]]  # a Fabric loop's one item per call


def test_one_item_per_trainer_batch_warns_that_steps_count_items(make_policy, vocab_size, tmp_path, monkeypatch):
    import tslightning.learner.update_stream as update_stream

    monkeypatch.setattr(update_stream, "_warned_item_per_batch", False)
    items = list(synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(0), SHAPE).stream())
    with pytest.warns(UserWarning, match="one stream item per batch: the Trainer then counts stream items as steps"):
        _trainer(tmp_path).fit(StreamingPolicyModule(make_policy()), DataLoader(items, batch_size=None))


def test_fabric_training_step_fires_on_before_optimizer_step_inside_the_barrier(make_policy, vocab_size):
    seen = []

    class Spy(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            seen.append(
                (pl_module.policy_version, float(torch.linalg.vector_norm(pl_module.layout.read_grads(torch.float64))))
            )

    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[Spy()])
    module = StreamingPolicyModule(make_policy(), max_grad_norm=None)
    wrapped, _ = fabric.setup(module, module.configure_optimizers())
    for index, item in enumerate(synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(0), SHAPE).stream()):
        wrapped.training_step(item, index)
    assert module.policy_version == 1
    assert seen == [(0, pytest.approx(module.last_update.direction_norm, rel=1e-12))]  # the direction was in .grad


def test_a_trainer_checkpoint_holds_the_policy_version_and_step_count(make_policy):
    module, checkpoint = StreamingPolicyModule(make_policy()), {}
    module.policy_version, module.num_optimizer_steps = 4, 4
    module.on_save_checkpoint(checkpoint)
    restored = StreamingPolicyModule(make_policy())
    restored.on_load_checkpoint(checkpoint)
    assert (restored.policy_version, restored.num_optimizer_steps) == (4, 4)
