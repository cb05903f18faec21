"""Handing the batch direction to a DeepSpeed ZeRO optimizer, whose gradients live inside the engine (Eq. 3).

Without ZeRO the barrier writes −g_k into each parameter's ``.grad``. ZeRO-2/3 reduce-scatter gradients into
partitioned buffers from hooks that run in the engine's backward, and the engine's step reads only those buffers,
so ``.grad`` written by hand is never seen. The route that reaches them is a backward pass: the surrogate

    L(θ) = −c · Σ_p ⟨p, d_p⟩,   d = g_k (already summed over ranks), c = the clipping coefficient,

has ∇_p L = −c·d_p exactly, on every rank. ZeRO averages gradients over the data-parallel ranks; the mean of equal
values is that value, so each partition receives exactly −c·g_k. (The direction thus crosses the ranks twice: the
barrier's all-reduce, then ZeRO's reduce-scatter of equal values.)

ZeRO-3 also partitions the parameters: outside a forward each holds only its shard, so the surrogate runs inside
:func:`gathered_parameters` (one all-gather of the whole model, on every rank at the barrier), and its backward runs
there too, while the parameters have their full shapes. On several ranks the learner's per-source passes run in
lock-step (:mod:`tslightning.distributed.lockstep`), because ZeRO-3 gathers each layer in every forward and backward.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import lightning as L
import torch
from lightning.fabric.strategies import DeepSpeedStrategy

from tslightning.core.parameter_layout import ParameterLayout

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
    with gathered_parameters(module):  # ZeRO-3: full shapes for the surrogate and for its backward's hooks
        terms = [
            (p * d.to(device=p.device, dtype=p.dtype)).sum()
            for p, d in zip(layout.parameters, layout.unflatten(direction), strict=True)
        ]
        engine.backward(torch.stack(terms).sum() * scale)  # what fabric.backward does for a DeepSpeed model


def partitions_parameters(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are partitioned by DeepSpeed ZeRO-3 (each rank holds only its shard)."""
    return any(hasattr(p, "ds_id") for p in module.parameters())


def release_pass_leftovers(module: L.LightningModule) -> None:
    """Release ZeRO-3 parameters a learner pass left gathered, as the engine's own backward does at its end.

    The learner's per-source backward is ``torch.autograd.grad``, not the engine's ``backward``; submodules whose
    post-backward hook never fires (the embedding: its input needs no gradient) stay gathered until released here.
    Local (not a collective); does nothing outside ZeRO-3.
    """
    fabric = deepspeed_fabric(module)
    if fabric is None or not fabric.strategy.zero_stage_3 or fabric.strategy.model is None:
        return
    fabric.strategy.model.optimizer.parameter_offload.release_backward_leftovers()


def gathered_parameters(module: torch.nn.Module) -> AbstractContextManager:
    """A context in which ``module``'s ZeRO-3 parameters have their full values on every rank (read-only).

    A collective under ZeRO-3 (every rank must enter it); does nothing for other modules.
    """
    if not partitions_parameters(module):
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
