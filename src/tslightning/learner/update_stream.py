"""An update's stream as a Lightning batch, and what the streaming module logs of each update.

Under a ``Trainer`` one batch is one update: the iterable of its stream items (:class:`BatchPlan` first,
:class:`BatchClosed` last), so the Trainer's step counter, ``log_every_n_steps``, learning-rate schedulers and
checkpoints all count updates. Given lazily (a generator that runs the update's rollout when first iterated, as
:meth:`~tslightning.rollout.rollout_datamodule.RolloutDataModule.train_dataloader` yields), the DataLoader's prefetch of
the next batch runs nothing: update k+1's plan is stamped after θ_{k+1} was published. A Fabric loop may still feed
one item per ``training_step`` call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import (
    BatchClosed,
    GroupClosed,
    Source,
    SourceError,
    StreamItem,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)
from tslightning.learner.compact_adamw import CompactAdamW
from tslightning.learner.update_log import log_update_metrics
from tslightning.learner.update_result import UpdateResult
from tslightning.objectives.advantages import AdvantageEstimator


class UpdateStreamHooks:
    """The streaming module's LightningModule hooks (one update per batch, its optimizer, checkpoint hooks) and
    what it reports of the last update (:meth:`named_direction`).

    Mixed into :class:`~tslightning.learner.streaming_module.StreamingPolicyModule`, whose ``ingest``, ``barrier``,
    ``max_grad_norm``, ``optimizer_settings``, ``last_direction``, ``last_update``, ``layout``, ``shards``,
    ``policy``, ``policy_version`` and ``num_optimizer_steps`` it uses.
    """

    @property
    def clips_gradients(self) -> bool:
        """Whether the barrier clips the batch direction itself (``max_grad_norm`` set); a
        :class:`~tslightning.callbacks.GradientClipping` callback then refuses to clip it again."""
        return self.max_grad_norm is not None

    def named_direction(self) -> dict[str, torch.Tensor]:
        """The last update's g_k per trainable parameter, keyed like ``policy.named_parameters()`` (views of
        :attr:`last_direction`; ascent direction, unclipped — see :meth:`barrier`)."""
        if self.last_direction is None or self.shards is not None:  # sharded: a shard of g_k (shards.gather)
            raise RuntimeError("named_direction: no update has run yet, or shard_statistics holds a shard of it")
        names = [name for name, p in self.policy.named_parameters() if p.requires_grad]
        return dict(zip(names, self.layout.unflatten(self.last_direction), strict=True))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """AdamW over the trainable parameters with :attr:`optimizer_settings` (moments in bfloat16 when its
        ``state_dtype`` says so)."""
        s = self.optimizer_settings
        settings = {"lr": s.lr, "betas": s.betas, "eps": s.eps, "weight_decay": s.weight_decay}
        if s.state_dtype == "bfloat16":
            return CompactAdamW(self.layout.parameters, **settings, state_dtype=torch.bfloat16)
        return torch.optim.AdamW(self.layout.parameters, **settings)

    def training_step(self, batch: Iterable[StreamItem | BatchPlan] | StreamItem | BatchPlan, batch_idx: int) -> None:
        """One update per Trainer batch: ``batch`` is the update's stream — its :class:`BatchPlan`, sources and events
        in readiness order, :class:`BatchClosed` last (a list, or a generator yielding each item as it becomes ready:
        each is served as it arrives, and with ``take_ready`` — :class:`~tslightning.rollout.ready_items.ReadyItems`
        — those ready at once together, :meth:`ingest_ready`) — and the barrier runs at ``BatchClosed``. A Fabric loop
        may instead pass one stream item per call. The barrier's :class:`UpdateResult` is kept in ``last_update`` and
        logged (one row per update, :mod:`tslightning.learner.update_log`).

        Under a Fabric the callbacks' ``on_before_optimizer_step`` runs inside the barrier, once the batch direction
        is in ``.grad`` (a Trainer's LightningOptimizer calls it inside ``step``).
        """
        for ready in update_backlogs(batch, under_trainer=self._trainer is not None):
            self.ingest_ready(ready)
            if isinstance(ready[-1], BatchClosed):
                optimizer = self.optimizers()
                self.barrier(optimizer, before_step=self._fabric_callbacks_before_step(optimizer))
                if self._trainer is not None or self._fabric is not None:
                    metrics = update_metrics(self.last_update, self.clips_gradients)
                    host = self.trainer if self._trainer is not None else self._fabric
                    log_update_metrics(host, self, metrics, step=self.policy_version - 1)

    def _fabric_callbacks_before_step(self, optimizer: Any) -> Callable[[], None] | None:
        if self._fabric is None:
            return None
        fabric = self._fabric
        return lambda: fabric.call("on_before_optimizer_step", trainer=fabric, pl_module=self, optimizer=optimizer)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """A Trainer checkpoint also holds the policy version and step count (``fit(ckpt_path=...)`` resumes them)."""
        checkpoint["streaming_policy_module"] = {
            "policy_version": self.policy_version,
            "num_optimizer_steps": self.num_optimizer_steps,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("streaming_policy_module")
        if state is not None:
            self.policy_version = state["policy_version"]
            self.num_optimizer_steps = state["num_optimizer_steps"]

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Stream items (and an update's iterable of them) pass through unchanged: they are frozen records, and each
        source's tokens move to the policy's device inside its own forward (held and queued sources stay on the
        host)."""
        return batch


_ITEM_TYPES = (BatchPlan, TrajectorySource, TurnSource, TrajectoryClosed, GroupClosed, BatchClosed)
_warned_item_per_batch = False


def update_backlogs(batch: object, under_trainer: bool) -> Iterator[list[StreamItem | BatchPlan]]:
    """The stream items of one ``training_step`` batch, checked in order, in lists of the items ready together: the
    item itself, or an update's items — each with those its stream has ready at once (its ``take_ready``, if any).

    Raises:
        SourceError: If an update's stream does not start with its BatchPlan, ends before BatchClosed, or continues
            after it (a batch holds exactly one update).
    """
    if isinstance(batch, _ITEM_TYPES):
        if under_trainer:
            _warn_item_per_batch()
        yield [batch]
        return
    if not isinstance(batch, Iterable):
        raise SourceError(
            f"training_step got a {type(batch).__name__}; give one update per batch (an iterable of its stream items, "
            "BatchPlan first and BatchClosed last) or one stream item"
        )
    take_ready = getattr(batch, "take_ready", list)
    closed, index, items = False, 0, iter(batch)
    while not closed:
        first = next(items, None)
        if first is None:
            raise SourceError("the update's stream ended before its BatchClosed; the batch is incomplete")
        ready = [first] if isinstance(first, BatchPlan) else [first, *take_ready()]
        for item in ready:
            if closed:
                raise SourceError(
                    f"the update's stream continues after BatchClosed with a {type(item).__name__}; one batch holds "
                    "exactly one update (yield each update's items as a separate batch)"
                )
            if index == 0 and not isinstance(item, BatchPlan):
                raise SourceError(f"an update's stream starts with its BatchPlan; the batch began with {item!r:.80}")
            index, closed = index + 1, isinstance(item, BatchClosed)
        yield ready
    extra = next(items, None)
    if extra is not None:
        raise SourceError(
            f"the update's stream continues after BatchClosed with a {type(extra).__name__}; one batch holds exactly "
            "one update (yield each update's items as a separate batch)"
        )


def _warn_item_per_batch() -> None:
    global _warned_item_per_batch
    if not _warned_item_per_batch:
        _warned_item_per_batch = True
        warnings.warn(
            "StreamingPolicyModule under a Trainer got one stream item per batch: the Trainer then counts stream "
            "items as steps (log_every_n_steps, logged rows, schedulers, checkpoints) and its prefetch pulls the next "
            "update's BatchPlan before this update's barrier; yield one update per batch instead (an iterable of its "
            "items, e.g. RolloutDataModule.train_dataloader())",
            stacklevel=3,
        )


def update_metrics(update: UpdateResult, module_clips: bool) -> dict[str, float]:
    """What the module logs of one barrier; the norm and clip coefficient only when it clipped (otherwise
    :class:`~tslightning.callbacks.GradientClipping` logs the norm and coefficient it applied)."""
    metrics = {
        "actor/num_sources": float(update.num_sources),
        "actor/num_scored_tokens": float(update.num_scored_tokens),
        "actor/policy_version": float(update.policy_version),
    }
    if module_clips:
        metrics["actor/grad_norm"] = update.direction_norm
        metrics["actor/grad_clip_coef"] = update.clip_coefficient
    return metrics


def vocabulary_size(policy: torch.nn.Module) -> int:
    """Rows of the policy's input embedding, through a peft wrapper (a LoRA on ``embed_tokens`` replaces the
    ``nn.Embedding`` with a layer that keeps it as ``base_layer``)."""
    embedding = policy.get_input_embeddings()
    while not hasattr(embedding, "num_embeddings") and hasattr(embedding, "base_layer"):
        embedding = embedding.base_layer
    return embedding.num_embeddings


def check_token_range(policy: torch.nn.Module, source: Source) -> None:
    """Refuse a source whose token ids (any of its sequences) lie outside the policy's vocabulary."""
    vocab = vocabulary_size(policy)
    sequences = source.sequences if isinstance(source, TrajectorySource) else [(source.token_ids, None)]
    top = max(int(ids.max()) for ids, _ in sequences)
    if top >= vocab:
        raise SourceError(
            f"{type(source).__name__}.token_ids holds id {top} but the policy's vocabulary has {vocab} entries; "
            "the rollout engine and learner must share one tokenizer"
        )


def check_plan(plan: BatchPlan, objective: Objective, advantage: AdvantageEstimator) -> None:
    """Refuse a plan for another objective, or GRPO groups too small for the ``advantage`` estimator."""
    if plan.objective is not objective:
        raise SourceError(f"BatchPlan.objective is {plan.objective.value}; this module trains {objective.value}")
    small = {g: m for g, m in plan.group_sizes.items() if m < advantage.min_group_size}
    if objective is Objective.GRPO and small:
        raise SourceError(
            f"BatchPlan.group_sizes {small} are too small for advantage {advantage.value!r}, which needs "
            f">= {advantage.min_group_size} trajectories per group"
        )
