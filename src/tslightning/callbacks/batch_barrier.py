"""The optimizer barrier's preconditions (Eq. 3), checked at the one step of an update.

:meth:`~tslightning.learner.streaming_module.StreamingPolicyModule.barrier` already refuses an incomplete batch before
it writes the batch direction; :class:`BatchBarrier` checks again at the step itself, so an optimizer step that did not
come from a complete logical batch at one policy version — a stray ``optimizer.step()``, a loop that skipped the
barrier, a source served at another version — fails loudly instead of moving θ.
"""

from __future__ import annotations

from typing import Any

import torch

from tslightning.callbacks.update_callback import UpdateCallback, module_name
from tslightning.core.batch_registry import BatchRegistry
from tslightning.core.sources import PolicyVersionError, SourceError

_SHOWN = 8  # offending sources named in an error message
_MISSING = object()


class BatchBarrier(UpdateCallback):
    """Refuses the optimizer step unless logical batch B_k is complete and, under zero staleness, served at θ_k.

    What it checks comes from the module (see :mod:`tslightning.callbacks.update_callback`): completeness from its
    ``registry`` (the :class:`~tslightning.core.batch_registry.BatchRegistry` of the open batch, as the streaming
    module keeps it); the versions from its ``service_log`` (each source's sampling ``policy_version``) and the
    registry's plan. A plain module that records a ``service_log`` per batch gets the version check; a module with
    neither is refused at the first hook.

    It acts in ``on_before_optimizer_step``: a Trainer's optimizer fires it inside ``step``; a Fabric loop calls
    ``fabric.call("on_before_optimizer_step", trainer=fabric, pl_module=module, optimizer=optimizer)`` — keywords, not
    positions — before ``optimizer.step()``, or passes that call as ``before_step=`` to the streaming module's
    ``barrier`` (its ``training_step`` does so under Fabric).

    Args:
        zero_staleness: Also require the batch plan and every served source to carry the learner's version k
            (the ``sync`` and ``thundersync`` schedules, Sec. 3.3). Set ``False`` for schedules with policy lag, whose
            lag :class:`~tslightning.callbacks.StalenessMonitor` bounds instead.
    """

    acts_before_step = True

    def __init__(self, zero_staleness: bool = True) -> None:
        super().__init__()
        self.zero_staleness = zero_staleness
        self.barriers_passed = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(zero_staleness=self.zero_staleness)

    def check_host(self, trainer: Any, pl_module: Any) -> None:
        has_registry = getattr(pl_module, "registry", _MISSING) is not _MISSING
        has_log = getattr(pl_module, "service_log", None) is not None
        if not has_registry and not (has_log and self.zero_staleness):
            raise ValueError(
                f"BatchBarrier has nothing to check on {module_name(pl_module)}: give the module a `registry` "
                "(the BatchRegistry of the open logical batch, for completeness)"
                + (
                    " or a `service_log` (each source's policy_version, for zero staleness)"
                    if self.zero_staleness
                    else ""
                )
                + ", or remove the callback"
            )

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        """Raise :class:`~tslightning.core.sources.SourceError` (or its ``PolicyVersionError``) before a premature step.

        Raises:
            SourceError: If no logical batch is open, or a registered trajectory, group or turn, or the batch
                itself, is still open.
            PolicyVersionError: Under zero staleness, if the plan or a served source carries another version.
        """
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        version = self.current_index(trainer, pl_module)
        registry = getattr(pl_module, "registry", _MISSING)
        if registry is not _MISSING:
            _require_open(registry, version).require_complete()
        if self.zero_staleness:
            _require_one_version(pl_module, None if registry is _MISSING else registry, version)
        self.barriers_passed += 1

    def state_dict(self) -> dict[str, Any]:
        return {"barriers_passed": self.barriers_passed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.barriers_passed = state_dict["barriers_passed"]


def _require_open(registry: BatchRegistry | None, version: int) -> BatchRegistry:
    """The completion state of the open logical batch."""
    if registry is None:
        raise SourceError(
            f"optimizer step at policy version {version} with no logical batch open; the only step of "
            "an update is the barrier's, after the batch's BatchPlan and BatchClosed"
        )
    return registry


def _require_one_version(module: Any, registry: BatchRegistry | None, version: int) -> None:
    """Zero staleness: the plan and every source served for update k were sampled by θ_k."""
    if registry is not None and registry.plan.policy_version != version:
        raise PolicyVersionError(
            f"the open batch was planned for version {registry.plan.policy_version} but the learner holds θ_{version}"
        )
    stale = [record for record in getattr(module, "service_log", None) or () if record.policy_version != version]
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
