"""Global-norm clipping of the batch direction at the barrier (Eq. 3, Table 5: clip 1.0), refusing non-finite steps.

The barrier writes the all-reduced batch direction into every rank's ``.grad`` before the step, so the norm each rank
computes locally is already the global one: no extra collective. (A sharded strategy such as FSDP would need the
strategy's own clipping.)
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch

# torch.nn.utils.clip_grads_with_norm_ scales by max_norm / (total_norm + 1e-6).
_TORCH_CLIP_EPS = 1e-6


class GradientClipping(L.Callback):
    """Clips the global norm of the trainable parameters' ``.grad`` before the optimizer step.

    The clipping is ``torch.nn.utils.clip_grad_norm_``'s, split in two so a non-finite norm is refused before any
    gradient is touched: the update raises and the optimizer never steps. Construct the module with
    ``max_grad_norm=None`` so the direction is clipped once. Logs ``actor/grad_norm`` (before clipping) and
    ``actor/grad_clip_coef`` at step k, the update's policy version.

    Args:
        max_norm: Largest global norm of the gradient the optimizer sees.
        norm_type: Order of the norm (``2.0``; ``math.inf`` for the max norm).
    """

    def __init__(self, max_norm: float = 1.0, norm_type: float = 2.0) -> None:
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
        self.last_grad_norm: float | None = None
        self.last_clip_coefficient: float | None = None

    def on_before_optimizer_step(
        self, trainer: L.Trainer | L.Fabric, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        """Clip ``.grad`` in place and log the pre-clip norm and the coefficient.

        Raises:
            ValueError: If the module clips too (``max_grad_norm`` is not ``None``).
            FloatingPointError: If the global norm is NaN or infinite; no gradient is changed and no step is taken.
        """
        _require_module_does_not_clip(pl_module)
        parameters = _trainable_parameters(optimizer)
        total_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None], self.norm_type)
        norm = float(total_norm)
        update = _update_name(pl_module)
        if not math.isfinite(norm):
            raise FloatingPointError(
                f"the batch direction of {update} has a non-finite global gradient norm ({norm}); refusing to step. "
                "Parameters are unchanged: find the source of the NaN/inf before retrying the update"
            )
        torch.nn.utils.clip_grads_with_norm_(parameters, self.max_norm, total_norm)
        coefficient = min(1.0, self.max_norm / (norm + _TORCH_CLIP_EPS))
        self._record(norm, coefficient)
        _log_on_rank_zero(
            trainer,
            {"actor/grad_norm": norm, "actor/grad_clip_coef": coefficient},
            step=getattr(pl_module, "policy_version", None),
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


def _require_module_does_not_clip(module: L.LightningModule) -> None:
    max_grad_norm = getattr(module, "max_grad_norm", None)
    if max_grad_norm is not None:
        raise ValueError(
            f"the module clips the batch direction itself (max_grad_norm={max_grad_norm}) and GradientClipping "
            "clips it again; construct the module with max_grad_norm=None when this callback clips"
        )


def _trainable_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters the optimizer steps, in its order (the module's layout order for ``configure_optimizers``)."""
    return [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]


def _update_name(module: L.LightningModule) -> str:
    version = getattr(module, "policy_version", None)
    return "this step" if version is None else f"update {version} (θ_{version} → θ_{version + 1})"


def _log_on_rank_zero(trainer: L.Trainer | L.Fabric, metrics: dict[str, float], step: int | None) -> None:
    if trainer.global_rank == 0:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
