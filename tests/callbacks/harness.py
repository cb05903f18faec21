"""What the callback tests share: the small GRPO workload, an in-memory logger, a recording engine, and the Trainer
and Fabric loops that run a StreamingPolicyModule's updates through a callback's hooks.

Imported as ``from harness import ...``: there is no ``__init__.py`` here, so pytest puts this directory on sys.path.
(The one-intra-op-thread fixture every module here uses is in this directory's ``conftest.py``.)
"""

from __future__ import annotations

import threading
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, IterableDataset

from tslightning.core.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch
from tslightning.core.sources import BatchClosed
from tslightning.learner.update_log import write_update_row
from tslightning.rollout.engine import PublishReceipt

SMALL = WorkloadShape(
    num_groups=2, group_size=3, max_turns=2, prompt_tokens=(3, 6), action_tokens=(2, 4), observation_tokens=(2, 4)
)
HOSTS = ["trainer", "fabric"]


class MemoryLogger(Logger):
    """Keeps every ``(step, metrics)`` it is given; works for a Trainer and for Fabric."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    name = "memory"
    version = 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def having(self, key: str) -> list[tuple[int | None, dict[str, float]]]:
        return [(step, metrics) for step, metrics in self.logged if key in metrics]


class FakeEngine:
    """Records each publication (a copy of the weights); acknowledges ``policy_version + version_offset``."""

    def __init__(self, version_offset: int = 0, hold: threading.Event | None = None) -> None:
        self.policy_version = 0
        self.published: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.version_offset = version_offset
        self.hold = hold

    def publish(self, state_dict, policy_version: int) -> PublishReceipt:
        if self.hold is not None:
            self.hold.wait(10)
        self.published.append((policy_version, {n: t.detach().clone() for n, t in state_dict.items()}))
        self.policy_version = policy_version
        return PublishReceipt(policy_version + self.version_offset, replicas=2, seconds=0.0)


def grpo_batch(vocab_size: int, version: int = 0) -> ReplayBatch:
    """The SMALL GRPO batch served at ``version``, from a generator seeded with the version."""
    return synthetic_grpo_batch(vocab_size, version, torch.Generator().manual_seed(version), SMALL)


def grpo_batches(vocab_size: int, count: int) -> list[ReplayBatch]:
    """``grpo_batch`` at versions 0 .. count - 1: one per update."""
    return [grpo_batch(vocab_size, version) for version in range(count)]


def fit(
    module: L.LightningModule,
    batches: list[ReplayBatch],
    callbacks: list[L.Callback],
    tmp_path: Path,
    *,
    logger: Logger | bool = False,
    enable_checkpointing: bool | None = False,
    max_steps: int = -1,
    ckpt_path: str | None = None,
) -> L.Trainer:
    """Each batch as one update: a CPU Trainer over the updates, one update (its stream items) per Trainer batch,
    a row logged every update. The stream starts at the module's policy version, so a run resumed with ``ckpt_path``
    continues where its checkpoint left off (give ``max_steps``: a checkpoint written at the end of training also
    ends its epoch). ``enable_checkpointing=None`` is Lightning's default (it adds a
    ModelCheckpoint). Returns the Trainer."""
    trainer = L.Trainer(
        max_epochs=1 if max_steps == -1 else -1,  # a step budget counts updates, across epochs
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=logger,
        enable_checkpointing=enable_checkpointing,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )
    loader = DataLoader(_Updates(module, batches), batch_size=None, collate_fn=_as_is)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer


class _Updates(IterableDataset):
    """The updates from the module's current policy version on, each as the list of its stream items."""

    def __init__(self, module, batches: list[ReplayBatch]) -> None:
        self.module, self.batches = module, batches

    def __iter__(self):
        for batch in self.batches[self.module.policy_version :]:
            yield list(batch.stream())


def _as_is(update: list) -> list:
    return update


def fabric_barrier(fabric: L.Fabric, module, optimizer) -> None:
    """Our Fabric loop's barrier: ``on_before_optimizer_step`` through ``fabric.call`` once the direction is in
    ``.grad``. Keywords, not positions: fabric.setup registers the LightningModule as a callback too, and Fabric
    passes each callback only the keywords its hook names (the module's hooks take no trainer/pl_module)."""
    module.barrier(
        optimizer,
        before_step=lambda: fabric.call(
            "on_before_optimizer_step", trainer=fabric, pl_module=module, optimizer=optimizer
        ),
    )


def run_updates(host: str, module, batches: list[ReplayBatch], callbacks, logger: Logger, tmp_path: Path) -> None:
    """Each batch as one update: a Trainer over its stream items, or our Fabric loop: the batch's items ingested,
    :func:`fabric_barrier`, then ``on_train_batch_end`` with the update's BatchClosed."""
    if host == "trainer":
        fit(module, batches, callbacks, tmp_path, logger=logger)
        return
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=callbacks, loggers=[logger])
    wrapped, optimizer = fabric.setup(module, module.configure_optimizers())
    for k, batch in enumerate(batches):
        for item in batch.stream():
            wrapped.ingest(item)
        fabric_barrier(fabric, wrapped, optimizer)
        fabric.call(
            "on_train_batch_end", trainer=fabric, pl_module=wrapped, outputs=None, batch=batch.items[-1], batch_idx=k
        )
        write_update_row(fabric)  # a Fabric loop writes the update's one row of metrics


def run_with_fabric_calls(fabric: L.Fabric, module, batch: ReplayBatch, publication_s: float | None = None) -> None:
    """Our Fabric loop over a set-up module: each stream item through ``training_step`` (the barrier at BatchClosed)
    between the batch hooks, called through ``fabric.call`` with keywords (the set-up LightningModule is a Fabric
    callback too, with its own hook signatures). With ``publication_s``, what a WeightPublisher records is set at
    BatchClosed before its ``on_train_batch_end``."""
    for index, item in enumerate(batch.stream()):
        fabric.call("on_train_batch_start", trainer=fabric, pl_module=module, batch=item, batch_idx=index)
        module.training_step(item, index)
        if publication_s is not None and isinstance(item, BatchClosed):
            module.update_timings["publication_s"] = publication_s
        fabric.call("on_train_batch_end", trainer=fabric, pl_module=module, outputs=None, batch=item, batch_idx=index)
    write_update_row(fabric)


class PlainModule(L.LightningModule):
    """A plain LightningModule as another project writes one: automatic optimization, ``self.log``, none of the
    streaming module's attributes. Least squares of one linear layer; SGD(lr=0.1)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1, dtype=torch.float64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.layer(x) - y) ** 2).mean()
        self.log("train/loss", loss, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def plain_batches(count: int, size: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(size, 4, generator=generator, dtype=torch.float64) * 10, torch.randn(size, 1, dtype=torch.float64))
        for _ in range(count)
    ]


def fit_plain(module: L.LightningModule, batches, callbacks, tmp_path: Path, **trainer_args) -> L.Trainer:
    """A plain CPU Trainer over ``batches`` (one optimizer step per batch unless accumulating), a row every step."""
    settings = dict(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
        default_root_dir=tmp_path,
    )
    trainer = L.Trainer(**(settings | trainer_args))
    trainer.fit(module, train_dataloaders=DataLoader(batches, batch_size=None, collate_fn=lambda batch: batch))
    return trainer


def fabric_plain_loop(module: L.LightningModule, batches, callbacks, loggers=(), before_step: bool = True) -> L.Fabric:
    """The documented plain Fabric loop: the train and batch hooks by keyword, ``on_before_optimizer_step`` before
    each ``optimizer.step()`` (unless ``before_step=False``: a loop that forgot it), and the update's row written
    after ``on_train_batch_end``."""
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=callbacks, loggers=list(loggers))
    wrapped, optimizer = fabric.setup(module, module.configure_optimizers())
    fabric.call("on_train_start", trainer=fabric, pl_module=wrapped)
    for index, batch in enumerate(batches):
        fabric.call("on_train_batch_start", trainer=fabric, pl_module=wrapped, batch=batch, batch_idx=index)
        x, y = batch
        loss = ((wrapped.layer(x) - y) ** 2).mean()
        fabric.backward(loss)
        if before_step:
            fabric.call("on_before_optimizer_step", trainer=fabric, pl_module=wrapped, optimizer=optimizer)
        optimizer.step()
        optimizer.zero_grad()
        fabric.call("on_train_batch_end", trainer=fabric, pl_module=wrapped, outputs=loss, batch=batch, batch_idx=index)
        write_update_row(fabric)
    fabric.call("on_train_end", trainer=fabric, pl_module=wrapped)
    return fabric
