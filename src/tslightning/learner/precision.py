"""Make Hugging Face models compute in the dtype they are run in, so float64 exactness tests mean float64.

``transformers``' RMSNorm layers (Qwen2, Llama, ...) upcast to float32 inside ``forward`` and cast back, so a
model moved to float64 still computes its norms — and their backward — in float32. Two mathematically equal
schedules then agree only to ~1e-8. For float64 verification we run the norm in the input dtype instead;
for float32 and bfloat16 the upstream behaviour is kept.
"""

from __future__ import annotations

import types

import torch


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
