"""Global-norm clipping of the update's gradient before the optimizer step (Eq. 3, Table 5: clip 1.0), refusing
non-finite steps.

It clips what the host's precision plugin names — Lightning's ``main_params(optimizer)``, after the plugin has
unscaled a GradScaler's gradients (a Trainer does so before ``on_before_optimizer_step``; under Fabric the callback
asks the plugin) — with the norm accumulated in float64 (:func:`~tslightning.core.parameter_layout.total_norm`).
Strategies whose gradients are sharded (FSDP, DeepSpeed) clip through ``fabric.clip_gradients`` under Fabric; under a
Trainer they clip with ``Trainer(gradient_clip_val=...)``, which this callback then leaves alone. The streaming
module's barrier writes the all-reduced batch direction into every rank's ``.grad``, so under DDP the local norm is
already the global one.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch

from tslightning.callbacks.update_callback import UpdateCallback, callbacks_of
from tslightning.core.parameter_layout import total_norm
from tslightning.learner.update_log import log_update_metrics

# torch.nn.utils.clip_grads_with_norm_ scales by max_norm / (total_norm + 1e-6).
_TORCH_CLIP_EPS = 1e-6


class GradientClipping(UpdateCallback):
    """Clips the global norm of the optimizer's gradients before its step; logs ``actor/grad_norm`` (before clipping)
    and ``actor/grad_clip_coef`` for update k.

    Refuses to clip twice: with ``Trainer(gradient_clip_val=...)``, with another GradientClipping, or with a module
    that declares ``clips_gradients`` (the streaming module built with ``max_grad_norm`` set: construct it with
    ``max_grad_norm=None``). A non-finite norm raises, so the optimizer never steps (replicated gradients are left
    untouched; a sharded strategy's ``clip_gradients`` has already scaled them) — except under a GradScaler (fp16
    mixed precision), where it is the scaler's overflow signal: the callback leaves the gradients alone, counts the
    update in ``skipped_updates`` and the scaler skips the step, as Lightning does.

    Args:
        max_norm: Largest global norm of the gradient the optimizer sees.
        norm_type: Order of the norm (``2.0``; ``math.inf`` for the max norm).
    """

    acts_before_step = True

    def __init__(self, max_norm: float = 1.0, norm_type: float = 2.0) -> None:
        super().__init__()
        problems = []
        if not max_norm > 0:
            problems.append(f"max_norm must be > 0 (Table 5 uses 1.0); got {max_norm}")
        if not norm_type > 0:
            problems.append(f"norm_type must be > 0 (2.0, or math.inf for the max norm); got {norm_type}")
        if problems:
            raise ValueError("GradientClipping: " + "; ".join(problems))
        self.max_norm = float(max_norm)
        self.norm_type = float(norm_type)
        self.updates = 0
        self.clipped_updates = 0
        self.skipped_updates = 0
        """GradScaler overflow steps left unclipped (and skipped by the scaler) in this run."""
        self.last_grad_norm: float | None = None
        self.last_clip_coefficient: float | None = None

    def check_host(self, trainer: Any, pl_module: Any) -> None:
        problems = []
        if getattr(pl_module, "clips_gradients", False):
            problems.append(
                f"the module clips its gradients itself (clips_gradients=True, e.g. max_grad_norm="
                f"{getattr(pl_module, 'max_grad_norm', '...')}); construct the module with max_grad_norm=None when "
                "this callback clips"
            )
        if isinstance(trainer, L.Trainer) and trainer.gradient_clip_val:
            problems.append(f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips too; keep one of the two")
        if sum(isinstance(cb, GradientClipping) for cb in callbacks_of(trainer)) > 1:
            problems.append("another GradientClipping is registered; the gradient would be clipped twice")
        if isinstance(trainer, L.Trainer) and _shards_gradients(trainer.strategy):
            problems.append(
                f"{type(trainer.strategy).__name__} shards the gradients: clip with Trainer(gradient_clip_val=...), "
                "which goes through the strategy"
            )
        if problems:
            raise ValueError("GradientClipping: " + "; ".join(problems))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: torch.optim.Optimizer) -> None:
        """Clip the gradients in place and log the pre-clip norm and the coefficient.

        Raises:
            ValueError: If something else clips too (see the class docstring).
            FloatingPointError: If the global norm is NaN or infinite without a GradScaler; no gradient is changed
                and no step is taken.
        """
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        k = self.current_index(trainer, pl_module)
        norm = self._clip(trainer, pl_module, optimizer, k)
        if norm is None:
            return
        coefficient = min(1.0, self.max_norm / (norm + _TORCH_CLIP_EPS))
        self._record(norm, coefficient)
        metrics = {"actor/grad_norm": norm, "actor/grad_clip_coef": coefficient}
        log_update_metrics(trainer, pl_module, metrics, step=k, prog_bar=["actor/grad_norm"])

    def _clip(self, trainer: Any, module: Any, optimizer: torch.optim.Optimizer, k: int) -> float | None:
        """Clip through the host; the pre-clip norm, or ``None`` for a GradScaler overflow step (left unclipped)."""
        precision = _precision(trainer)
        scaled = getattr(precision, "scaler", None) is not None
        if isinstance(trainer, L.Fabric) and _shards_gradients(trainer.strategy, module):
            clip = {"max_norm": self.max_norm, "norm_type": self.norm_type, "error_if_nonfinite": False}
            return self._finite_or_skipped(float(trainer.clip_gradients(module, optimizer, **clip)), scaled, k)
        if isinstance(trainer, L.Fabric):
            optimizer = getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside a _FabricOptimizer
            precision.unscale_gradients(optimizer)  # a no-op without a GradScaler
        parameters = list(precision.main_params(optimizer)) if precision is not None else _parameters(optimizer)
        grad_norm = total_norm((p.grad for p in parameters if p.grad is not None), self.norm_type)
        if self._finite_or_skipped(float(grad_norm), scaled, k) is None:
            return None
        torch.nn.utils.clip_grads_with_norm_(parameters, self.max_norm, grad_norm)
        return float(grad_norm)

    def _finite_or_skipped(self, norm: float, scaled: bool, k: int) -> float | None:
        if math.isfinite(norm):
            return norm
        if scaled:  # the scaler found inf/NaN while unscaling and will skip this step
            self.skipped_updates += 1
            return None
        raise FloatingPointError(
            f"the gradient of update {k} (θ_{k} → θ_{k + 1}) has a non-finite global norm ({norm}); refusing to step. "
            "Parameters are unchanged: find the source of the NaN/inf before retrying the update"
        )

    def _record(self, norm: float, coefficient: float) -> None:
        self.updates += 1
        self.clipped_updates += int(coefficient < 1.0)
        self.last_grad_norm = norm
        self.last_clip_coefficient = coefficient

    def state_dict(self) -> dict[str, Any]:
        return {
            "updates": self.updates,
            "clipped_updates": self.clipped_updates,
            "last_grad_norm": self.last_grad_norm,
            "last_clip_coefficient": self.last_clip_coefficient,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.updates = state_dict["updates"]
        self.clipped_updates = state_dict["clipped_updates"]
        self.last_grad_norm = state_dict["last_grad_norm"]
        self.last_clip_coefficient = state_dict["last_clip_coefficient"]


def _precision(trainer: Any) -> Any:
    """The host's precision plugin (a Trainer's ``precision_plugin``, Fabric's ``strategy.precision``)."""
    if isinstance(trainer, L.Trainer):
        return trainer.precision_plugin
    strategy = getattr(trainer, "strategy", None)
    return getattr(strategy, "precision", None)


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _shards_gradients(strategy: Any, module: Any = None) -> bool:
    """Whether the gradients are sharded: the module's parameter placement says so when it has one (the streaming
    module's); else the strategy's kind."""
    placement = getattr(module, "placement", None)
    if placement is not None:
        return placement.clips_in_module
    from lightning.fabric import strategies as fabric
    from lightning.pytorch import strategies as trainer

    sharded = (
        fabric.DeepSpeedStrategy,
        fabric.FSDPStrategy,
        fabric.ModelParallelStrategy,
        trainer.DeepSpeedStrategy,
        trainer.FSDPStrategy,
        trainer.ModelParallelStrategy,
    )
    return isinstance(strategy, sharded)
