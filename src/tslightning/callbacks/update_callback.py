"""How a tslightning callback sees an *update*, on any LightningModule, under a ``Trainer`` and under Fabric.

An update is one optimizer step θ_k → θ_{k+1} with the batch that produced it:

* a plain LightningModule: the Trainer batch during which the optimizer stepped (with gradient accumulation, the
  batches since the previous step). It opens at ``on_train_batch_start`` and closes at the ``on_train_batch_end`` of a
  batch during which ``on_before_optimizer_step`` fired.
* the :class:`~tslightning.learner.streaming_module.StreamingPolicyModule`: logical batch B_k, from its
  :class:`~tslightning.core.batch_registry.BatchPlan` to its barrier — one Trainer batch holding the update's stream,
  or, in a Fabric loop feeding one stream item per call, from the ``BatchPlan`` item to the ``BatchClosed`` item.

Its index k — the step it is logged at, the policy version it was computed at — is ``module.policy_version`` before
the step when the module has that attribute; else, under a Trainer, ``trainer.global_step``; else (Fabric) the number
of updates the callback has seen, kept in its ``state_dict``.

A Fabric loop fires the hooks itself, by keyword (Fabric passes each callback only the names its hook takes, and a
set-up LightningModule is a callback too): ``fabric.call("on_train_start", trainer=fabric, pl_module=module)``;
per batch ``"on_train_batch_start"`` (``batch=..., batch_idx=...``); ``"on_before_optimizer_step"`` (``optimizer=``)
right before ``optimizer.step()`` — Fabric never fires it, and it is where clipping and the barrier checks act; then
``"on_train_batch_end"`` (``outputs=, batch=, batch_idx=``); finally ``"on_train_end"``. The streaming module's
``training_step`` and ``barrier(optimizer, before_step=...)`` fire ``on_before_optimizer_step`` for you. Under Fabric
the callbacks also watch the module's optimizers (a step-post hook), so a loop that forgets
``on_before_optimizer_step`` still ends its updates — but BatchBarrier and GradientClipping, which act there, raise.

What a module may provide — every attribute optional; a callback that needs a missing one raises (or, where it can
still do part of its job, warns once) naming it, at the first hook:

==================  =========================================================  ======================================
attribute           meaning                                                    read by
==================  =========================================================  ======================================
``policy_version``  int, the version of θ held; +1 per update                  every callback (k); WeightPublisher
``policy``          the ``nn.Module`` rollout engines serve                    WeightPublisher (or its ``policy=``),
                                                                               MFUMonitor, GPUClockCheckpoint (hash)
``service_log``     the update's sources, each with ``policy_version``,        StalenessMonitor, BatchBarrier,
                    ``tokens``, ``scored_tokens``, ``start``, ``end``,         ReleaseTraceRecorder, MFUMonitor,
                    ``kind``, ``group_id``, ``trajectory_index``,              GPUClockCheckpoint (counts)
                    ``turn_index`` (:class:`~tslightning.ServiceRecord`)
``registry``        the open logical batch's BatchRegistry (or ``None``)       BatchBarrier (completeness)
``update_timings``  seconds per phase (``learner_service_s``, ``barrier_s``,   MFUMonitor, ReleaseTraceRecorder
                    ``rollout_wait_s``, ``publication_s``)
``flops_per_batch`` learner FLOPs of the update on this rank, as Lightning's   MFUMonitor (or its ``flops_fn=``)
                    ``ThroughputMonitor`` reads it
``clips_gradients`` bool, the module clips its own gradients                   GradientClipping refuses to clip twice
==================  =========================================================  ======================================

Order: callbacks that read the publication's timing (MFUMonitor, ReleaseTraceRecorder, GPUClockCheckpoint) find it on
the :class:`~tslightning.callbacks.WeightPublisher` itself, and refuse to run before one; GPUClockCheckpoint must
follow every callback whose state it saves. These orders are checked at the first hook, not silently assumed.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric.wrappers import _unwrap_objects

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed, GroupClosed, TrajectoryClosed, TrajectorySource, TurnSource
from tslightning.learner.update_log import write_update_row

_STREAM_ITEMS = (BatchPlan, TrajectorySource, TurnSource, TrajectoryClosed, GroupClosed, BatchClosed)


@dataclass(frozen=True)
class Publication:
    """One publication of θ_{k+1}: its version, how long until every replica acknowledged, and when (Unix time)."""

    policy_version: int
    seconds: float
    acknowledged_at: float


def held_version(trainer: Any, module: Any) -> int | None:
    """The version of θ the module holds now: ``module.policy_version``, else a Trainer's ``global_step``."""
    version = getattr(module, "policy_version", None)
    if isinstance(version, int) and not isinstance(version, bool):
        return version
    if isinstance(trainer, L.Trainer):
        return trainer.global_step
    return None


def module_name(module: Any) -> str:
    """The class name of ``module`` (of the LightningModule inside Fabric's wrapper), for messages."""
    return type(_unwrap_objects(module)).__name__


def callbacks_of(trainer: Any) -> list[Any]:
    """The host's callbacks in the order it calls them (Fabric has no public accessor; its list also holds the
    set-up LightningModule, which is no ``Callback``)."""
    if isinstance(trainer, L.Trainer):
        return list(trainer.callbacks)
    return [cb for cb in getattr(trainer, "_callbacks", []) if isinstance(cb, L.Callback)]


def sum_over_ranks(trainer: Any, values: list[float]) -> list[float]:
    """``values`` summed over every rank (a collective; one process: unchanged). A Trainer's strategy names the
    collective ``reduce``, Fabric's ``all_reduce``."""
    if trainer.world_size == 1:
        return list(values)
    strategy = trainer.strategy
    reduce = getattr(strategy, "all_reduce", None) or strategy.reduce
    tensor = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
    return reduce(tensor, reduce_op="sum").tolist()


class UpdateCallback(L.Callback):
    """Base of the tslightning callbacks: finds each update's start and end (module docstring) and calls
    :meth:`on_update_start` / :meth:`on_update_end` with its index k. Subclasses that act in another hook call
    ``super()`` there."""

    reads_publication = False
    """Reads :meth:`publication`: must come after every WeightPublisher."""
    publishes = False
    acts_before_step = False
    """Acts in ``on_before_optimizer_step``: an optimizer step without that hook is an error, not a silent no-op."""

    def __init__(self) -> None:
        self.updates_seen = 0
        self._open = False
        self._announced = False  # on_before_optimizer_step fired in the open update
        self._optimizer_stepped = False  # an optimizer of the module stepped in the open update (Fabric)
        self._step_hooks: list[Any] = []
        self._checked: Any = None
        self.last_update_index: int | None = None
        """k of the last update this callback saw end."""

    # ----------------------------------------------------------------- what subclasses implement
    def on_update_start(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """Update k opens (before any of its learner work)."""

    def on_update_end(self, trainer: Any, pl_module: Any, k: int, batch: Any) -> None:
        """Update k took its step (and, for callbacks after a WeightPublisher, was published)."""

    def check_host(self, trainer: Any, pl_module: Any) -> None:
        """Raise (or warn once) if this callback cannot act on this module and host; called at the first hook."""

    # ----------------------------------------------------------------- Lightning hooks
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._check_once(trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._check_once(trainer, pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._check_once(trainer, pl_module)
        # One stream item per batch: the BatchPlan opens the update; otherwise the first batch after the last step.
        opens = isinstance(batch, BatchPlan) if isinstance(batch, _STREAM_ITEMS) else not self._open
        if opens:
            self._open, self._announced, self._optimizer_stepped = True, False, False
            self.on_update_start(trainer, pl_module, batch)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        self._check_once(trainer, pl_module)
        self._announced = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._check_once(trainer, pl_module)
        stepped = self._announced or self._optimizer_stepped
        closes = isinstance(batch, BatchClosed) if isinstance(batch, _STREAM_ITEMS) else self._open and stepped
        if not closes:
            return
        if self.acts_before_step and self._optimizer_stepped and not self._announced:
            raise ValueError(
                f"{type(self).__name__}: the optimizer stepped without on_before_optimizer_step, where this callback "
                'acts; a Fabric loop calls fabric.call("on_before_optimizer_step", trainer=fabric, pl_module=module, '
                "optimizer=optimizer) right before optimizer.step()"
            )
        k = self._closed_index(trainer, pl_module, batch)
        self._open = self._announced = self._optimizer_stepped = False
        self.updates_seen += 1
        self.last_update_index = k
        self.on_update_end(trainer, pl_module, k, batch)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        write_update_row(trainer)  # the last update's row, if the loop did not write it
        for handle in self._step_hooks:
            handle.remove()
        self._step_hooks = []

    # ----------------------------------------------------------------- for subclasses
    def current_index(self, trainer: Any, pl_module: Any) -> int:
        """k of the update in progress (before its step)."""
        version = held_version(trainer, pl_module)
        return self.updates_seen if version is None else version

    def publication(self, trainer: Any, pl_module: Any, k: int) -> Publication | None:
        """θ_{k+1}'s publication: from a WeightPublisher of this host, else what the module's ``update_timings``
        record (a loop that publishes itself), else ``None``."""
        for callback in callbacks_of(trainer):
            record = getattr(callback, "last_publication", None) if getattr(callback, "publishes", False) else None
            if record is not None and record.policy_version == k + 1:
                return record
        timings = getattr(pl_module, "update_timings", None)
        if isinstance(timings, dict) and "publication_s" in timings:
            return Publication(k + 1, timings["publication_s"], time.time())
        return None

    def warn_once(self, message: str) -> None:
        """Warn ``message`` the first time only (per callback instance)."""
        warned = self.__dict__.setdefault("_warned", set())
        if message not in warned:
            warned.add(message)
            warnings.warn(f"{type(self).__name__}: {message}", stacklevel=3)

    # ----------------------------------------------------------------- internals
    def _closed_index(self, trainer: Any, pl_module: Any, batch: Any) -> int:
        version = held_version(trainer, pl_module)
        if version is not None:
            return version - 1  # the step made it k + 1
        if isinstance(batch, BatchClosed):
            return batch.policy_version
        return self.updates_seen

    def _watch_optimizers(self, trainer: Any, pl_module: Any) -> None:
        """Fabric fires no hook itself: an optimizer step-post hook tells when an update stepped even if the loop
        forgot ``on_before_optimizer_step`` (a Trainer always fires it)."""
        if isinstance(trainer, L.Trainer):
            return
        for optimizer in _module_optimizers(pl_module):
            self._step_hooks.append(optimizer.register_step_post_hook(self._on_optimizer_step))

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_stepped = True

    def _check_once(self, trainer: Any, pl_module: Any) -> None:
        if self._checked is trainer:
            return
        self._checked = trainer
        self.check_host(trainer, pl_module)
        self._watch_optimizers(trainer, pl_module)
        callbacks = callbacks_of(trainer)
        if self in callbacks:
            _check_unique_key(self, callbacks)
            if self.reads_publication:
                _check_after_publishers(self, callbacks)


def _module_optimizers(pl_module: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers a Fabric-set-up LightningModule steps (none when it has no host yet)."""
    try:
        optimizers = pl_module.optimizers()
    except (AttributeError, RuntimeError):
        return []
    optimizers = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
    raw = [getattr(optimizer, "optimizer", optimizer) for optimizer in optimizers]
    return [optimizer for optimizer in raw if isinstance(optimizer, torch.optim.Optimizer)]


def _check_unique_key(callback: L.Callback, callbacks: list[Any]) -> None:
    twins = [cb for cb in callbacks if cb is not callback and cb.state_key == callback.state_key]
    if twins:
        raise ValueError(
            f"{len(twins) + 1} callbacks share state_key {callback.state_key!r}: a checkpoint would hold one state "
            f"for them all; give each {type(callback).__name__} a distinct name= (or distinct settings)"
        )


def _check_after_publishers(callback: UpdateCallback, callbacks: list[Any]) -> None:
    later = [cb for cb in callbacks[callbacks.index(callback) + 1 :] if getattr(cb, "publishes", False)]
    if later:
        raise ValueError(
            f"{type(callback).__name__} comes before {type(later[0]).__name__} in the callbacks: it reads the "
            "publication of θ_{k+1} (its time ends the update), which the publisher records when it runs; put "
            f"{type(callback).__name__} after the publisher"
        )
