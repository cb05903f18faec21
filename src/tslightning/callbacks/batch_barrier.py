"""The optimizer barrier's preconditions (Eq. 3), checked at the one step of an update.

:meth:`~tslightning.learner.streaming_module.StreamingPolicyModule.barrier` already refuses an incomplete batch before
it writes the batch direction; :class:`BatchBarrier` checks again at the step itself, so an optimizer step that did not
come from a complete logical batch at one policy version — a stray ``optimizer.step()``, a loop that skipped the
barrier, a source served at another version — fails loudly instead of moving θ.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from tslightning.core.batch_registry import BatchRegistry
from tslightning.core.sources import PolicyVersionError, SourceError

_SHOWN = 8  # offending sources named in an error message


class BatchBarrier(L.Callback):
    """Refuses the optimizer step unless logical batch B_k is complete and, under zero staleness, served at θ_k.

    Works under a Lightning ``Trainer`` (its LightningOptimizer calls ``on_before_optimizer_step`` inside ``step``)
    and under a Fabric loop that passes ``before_step=lambda: fabric.call("on_before_optimizer_step", fabric,
    module, optimizer)`` to :meth:`~tslightning.learner.streaming_module.StreamingPolicyModule.barrier`.

    Args:
        zero_staleness: Also require the batch plan and every served source to carry the learner's version k
            (the ``sync`` and ``thundersync`` schedules, SPEC §3). Set ``False`` for schedules with policy lag, whose
            lag :class:`~tslightning.callbacks.StalenessMonitor` bounds instead.
    """

    def __init__(self, zero_staleness: bool = True) -> None:
        self.zero_staleness = zero_staleness
        self.barriers_passed = 0

    def on_before_optimizer_step(
        self, trainer: L.Trainer | L.Fabric, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Raise :class:`~tslightning.core.sources.SourceError` (or its ``PolicyVersionError``) before a premature step.

        Raises:
            SourceError: If no logical batch is open, or a registered trajectory, group or turn, or the batch
                itself, is still open.
            PolicyVersionError: Under zero staleness, if the plan or a served source carries another version.
        """
        registry = _open_registry(pl_module)
        registry.require_complete()
        if self.zero_staleness:
            _require_one_version(pl_module, registry)
        self.barriers_passed += 1

    def state_dict(self) -> dict[str, Any]:
        return {"barriers_passed": self.barriers_passed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.barriers_passed = state_dict["barriers_passed"]


def _open_registry(module: L.LightningModule) -> BatchRegistry:
    """The completion state of the open logical batch."""
    registry = getattr(module, "registry", None)
    if registry is None:
        raise SourceError(
            f"optimizer step at policy version {module.policy_version} with no logical batch open; the only step of "
            "an update is the barrier's, after the batch's BatchPlan and BatchClosed"
        )
    return registry


def _require_one_version(module: L.LightningModule, registry: BatchRegistry) -> None:
    """Zero staleness: the plan and every source served for update k were sampled by θ_k."""
    version = module.policy_version
    if registry.plan.policy_version != version:
        raise PolicyVersionError(
            f"the open batch was planned for version {registry.plan.policy_version} but the learner holds θ_{version}"
        )
    stale = [record for record in module.service_log if record.policy_version != version]
    if stale:
        shown = ", ".join(
            f"({r.group_id!r}, trajectory {r.trajectory_index}"
            + ("" if r.turn_index is None else f", turn {r.turn_index}")
            + f") at version {r.policy_version}"
            for r in stale[:_SHOWN]
        )
        raise PolicyVersionError(
            f"{len(stale)} source(s) served for update {version} carry another policy version: {shown}"
            + (" ..." if len(stale) > _SHOWN else "")
            + "; zero-staleness schedules never step on a source sampled by another policy"
        )
