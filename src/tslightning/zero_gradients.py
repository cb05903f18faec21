"""Handing the batch direction to a DeepSpeed ZeRO optimizer, whose gradients live inside the engine (Eq. 3).

Without ZeRO the barrier writes −g_k into each parameter's ``.grad``. ZeRO-2/3 reduce-scatter gradients into
partitioned buffers from hooks that run in the engine's backward, and the engine's step reads only those buffers,
so ``.grad`` written by hand is never seen. The route that reaches them is a backward pass: the surrogate

    L(θ) = −c · Σ_p ⟨p, d_p⟩,   d = g_k (already summed over ranks), c = the clipping coefficient,

has ∇_p L = −c·d_p exactly, on every rank. ZeRO averages gradients over the data-parallel ranks; the mean of equal
values is that value, so each partition receives exactly −c·g_k. (The direction thus crosses the ranks twice: the
barrier's all-reduce, then ZeRO's reduce-scatter of equal values.)

ZeRO-3 is refused on several ranks: it all-gathers each layer's parameters in every forward and backward, a
collective that all ranks must enter in step, while streaming ranks run different numbers of per-source forwards
in their own readiness order (uneven shares), so the gathers never pair up and the ranks wait until the process
group's timeout. Running it needs either the whole model gathered for the update (ZeRO-2's memory for parameters)
or lock-step learner ticks with idle ranks running empty forwards.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.fabric.strategies import DeepSpeedStrategy

from tslightning.parameter_layout import ParameterLayout

# torch.nn.utils.clip_grad_norm_ scales by max_norm / (total_norm + 1e-6), clamped at 1.
_TORCH_CLIP_EPS = 1e-6


def deepspeed_fabric(module: L.LightningModule) -> L.Fabric | None:
    """The Fabric that set up ``module`` with a DeepSpeed strategy, or ``None`` (no Fabric, or another strategy)."""
    fabric = getattr(module, "_fabric", None)
    if fabric is not None and isinstance(fabric.strategy, DeepSpeedStrategy):
        return fabric
    return None


def clip_coefficient(norm: float, max_norm: float | None) -> float:
    """``clip_grad_norm_``'s coefficient for a direction of global norm ``norm`` (1.0 when not clipping)."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (norm + _TORCH_CLIP_EPS))


def backward_direction(
    fabric: L.Fabric, module: torch.nn.Module, layout: ParameterLayout, direction: torch.Tensor, scale: float
) -> None:
    """Run the engine's backward on a surrogate whose gradient is ``scale · direction`` (see the module docstring).

    Raises:
        RuntimeError: if ``module`` is not the model of the strategy's engine (the one its optimizer steps).
    """
    engine = fabric.strategy.model
    if engine is None or engine.module is not module:
        raise RuntimeError(
            "DeepSpeed: this StreamingPolicyModule is not the model of the strategy's current engine, whose optimizer "
            "the barrier steps; set it up with fabric.setup(module, optimizer) last (one engine per module)"
        )
    check_zero_stage(fabric.strategy, fabric.world_size)
    terms = [
        (p * d.to(device=p.device, dtype=p.dtype)).sum()
        for p, d in zip(layout.parameters, layout.unflatten(direction), strict=True)
    ]
    engine.backward(torch.stack(terms).sum() * scale)  # what fabric.backward does for a DeepSpeed model


def check_zero_stage(strategy: DeepSpeedStrategy, world_size: int) -> None:
    """Raise ``ValueError`` for ZeRO-3 on several ranks (see the module docstring)."""
    if strategy.zero_stage_3 and world_size > 1:
        raise ValueError(
            "DeepSpeed ZeRO-3 cannot stream on several learner ranks: its per-layer parameter all-gathers in every "
            "forward need all ranks in step, while each rank streams its own sources; use deepspeed_stage_2 or ddp"
        )
