"""Learner precision: the dtypes each of Fabric's precision settings implies, and float64 norms for exactness checks.

``32-true``, ``64-true``, ``bf16-true``: weights, gradients and optimizer state in that dtype. ``bf16-mixed``: bfloat16
compute (autocast) over float32 master weights, float32 gradients and float32 AdamW state — so updates far below
bfloat16's resolution (lr 1e-6) still land; with LoRA the frozen base is kept in bfloat16 and the trainable adapters
in float32. The engines serve bfloat16 under both bf16 settings, and float32 under ``64-true``.

``transformers``' RMSNorm layers (Qwen2, Llama, ...) upcast to float32 inside ``forward`` and cast back, so a
model moved to float64 still computes its norms — and their backward — in float32. Two mathematically equal
schedules then agree only to ~1e-8. For float64 verification we run the norm in the input dtype instead;
for float32 and bfloat16 the upstream behaviour is kept.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, Literal

import torch

Precision = Literal["32-true", "64-true", "bf16-mixed", "bf16-true"]
"""Fabric's precision names the learner supports."""

_WEIGHTS = {
    "32-true": torch.float32,
    "64-true": torch.float64,
    "bf16-mixed": torch.float32,
    "bf16-true": torch.bfloat16,
}


def weight_dtype(precision: Precision, frozen: bool = False) -> torch.dtype:
    """The dtype of trainable weights (and their master copy), or of frozen ones (a LoRA base) under ``precision``."""
    if frozen and precision == "bf16-mixed":
        return torch.bfloat16  # a frozen base needs no master copy
    return _WEIGHTS[precision]


def pass_context(module: Any) -> AbstractContextManager:
    """The precision context a LightningModule's own policy passes run in: the Fabric's or Trainer's it is attached
    to (``bf16-mixed``: bfloat16 autocast), else none. Passes the module runs outside ``forward`` need it: Fabric and
    the Trainer apply it to ``forward`` only.

    Autocast's weight cache is turned off inside it: the cache keeps the bfloat16 copy of every weight it casts until
    the region ends — for a learner pass, a bfloat16 copy of the whole model (+13 GiB at 7B, +60 GiB at 32B). Without
    it each use casts again (one more cast per weight use); the copy a matmul keeps for its backward is an ordinary
    saved activation, freed with the layer's (and recomputed with it under activation checkpointing)."""
    fabric = getattr(module, "_fabric", None)
    if fabric is not None:
        return _without_weight_cache(fabric.autocast())
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        return _without_weight_cache(trainer.precision_plugin.forward_context())
    return nullcontext()


@contextmanager
def _without_weight_cache(context: AbstractContextManager) -> Iterator[None]:
    with context:
        device = next((d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)), None)
        if device is None:
            yield
            return
        with torch.autocast(device, dtype=torch.get_autocast_dtype(device), cache_enabled=False):
            yield


def serving_dtype(precision: Precision) -> str:
    """The dtype rollout engines serve θ_k in: the compute dtype, float32 for a float64 learner."""
    return "bfloat16" if precision.startswith("bf16") else "float32"


def _rms_norm_in_input_dtype(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def compute_norms_in_float64(model: torch.nn.Module) -> int:
    """Patch every RMSNorm of a float64 ``model`` to compute in float64; returns how many were patched.

    Raises:
        ValueError: if the model's parameters are not float64 (the patch would change float32/bf16 numerics).
    """
    dtype = next(model.parameters()).dtype
    if dtype != torch.float64:
        raise ValueError(f"compute_norms_in_float64 is for float64 models; this one is {dtype}")
    patched = 0
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
            patched += 1
    return patched
