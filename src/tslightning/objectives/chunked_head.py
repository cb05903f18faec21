"""The output head scored in row chunks: log π_θ(a_t | h_t) from the final hidden states without T×V logits.

A pass that materializes the logits holds ``rows × V`` of them plus their float32 log-softmax for the backward:
~10 GiB of bfloat16 logits and ~19 GiB of float32 log-softmax for a 32,768-token pass at V = 152,064.
:class:`ChunkedHeadLogprobs` runs the head's matmul, the log-softmax and the gather of the scored token over chunks
of at most ``chunk_rows`` rows and keeps only the hidden rows (the head's weight and bias by reference, as
``F.linear`` does). Its backward recomputes each chunk's logits and back-propagates through exactly the same ops,
adding up the gradients of the hidden rows and of the weight (and bias). Per row these are the full-logits
computation's ops, so values and gradients equal it up to the order the weight gradient's rows are summed in
(float64: ~1e-15 relative). The cost is one more head matmul per scored row in the backward: 8·H·V FLOPs per scored
row against the full-logits pass's 6·H·V per *position*, so it costs less whenever under 3/4 of the positions are
scored, and at most 2.3% of a Qwen2.5-7B pass (every one of 4,096 tokens scored; 1.3% at 32,768), 0.75% at 32B.

:func:`scoring_head` makes a causal LM's own head this scorer for the duration of one forward, so the scoring runs
*inside* the model's forward, where sharding strategies have the head's weight at hand: FSDP2's root unit holds it
unsharded while the root runs (and re-gathers it for the backward from its pre-backward hook), DeepSpeed ZeRO-3
gathers it around the head module's own call and again from the hooks it puts on the head's output. The learner
passes ``logits_to_keep`` (an index tensor, transformers' causal LMs hand ``hidden_states[:, logits_to_keep]`` to
the head), so only the scored rows reach it; what the model returns as ``logits`` is then the ``(N,)`` log-probs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_ROWS = 1024
"""Rows per head chunk by default: a chunk's transient logits and log-softmax cost ~10 bytes × V per row in the
forward and ~16 in the backward (~2.3 GiB at V = 152,064), while 1024 rows keep the head's matmul large enough to
run at full speed on a GPU (M = 1024 fills tensor cores; much smaller chunks pay in kernel launches and weight
reads)."""

_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config attributes of transformers' causal LMs that transform the head's output before returning it (Gemma's
soft-capping, Cohere's and Granite's scaling): such a model's logits are not the head's, so it is scored through
its returned logits instead."""


class ChunkedHeadLogprobs(torch.autograd.Function):
    """``(N,)`` ``log_softmax(F.linear(hidden, weight, bias))[row, target]`` computed ``chunk_rows`` rows at a time.

    Under autocast the matmul runs in autocast's dtype, as ``F.linear`` would: the inputs are cast explicitly (the
    weight once per call, not cached for the rest of the pass as autocast's cache would keep it), then the chunk's
    half-precision logits are upcast to float32 for the log-softmax; float32 and float64 stay as they are. The
    backward re-creates those casts, so a recomputed chunk is bit for bit the forward's. Transient memory: one chunk's
    logits, log-softmax and their gradients (~16 bytes × V per row), the cast weight and one chunk's weight gradient
    in the compute dtype, beside the weight gradient it returns.
    """

    @staticmethod
    def forward(ctx, hidden, targets, chunk_rows, weight, bias):  # noqa: ANN001, ANN205 (autograd's signature)
        ctx.chunk_rows, ctx.hidden_dtype = chunk_rows, hidden.dtype
        ctx.dtype = _autocast_dtype(hidden.device.type)
        with _no_autocast(hidden.device.type):
            rows = _cast(hidden, ctx.dtype)  # kept as the matmul reads them (bf16 under autocast, as F.linear keeps)
            w, b = _cast(weight, ctx.dtype), _cast(bias, ctx.dtype)
            chunks = [
                _chunk_logprobs(rows[i : i + chunk_rows], targets[i : i + chunk_rows], w, b)
                for i in range(0, rows.shape[0], chunk_rows)
            ]
        ctx.save_for_backward(rows, targets, weight, bias)
        return torch.cat(chunks) if chunks else _chunk_logprobs(rows, targets, w, b)

    @staticmethod
    def backward(ctx, grad_output):  # noqa: ANN001, ANN205
        rows, targets, weight, bias = ctx.saved_tensors
        need_hidden, _, _, need_weight, need_bias = ctx.needs_input_grad
        if not (need_hidden or need_weight or need_bias):
            return None, None, None, None, None
        w = _cast(weight.detach(), ctx.dtype).requires_grad_(need_weight)
        b = None if bias is None else _cast(bias.detach(), ctx.dtype).requires_grad_(need_bias)
        sums = {  # leaf in the compute dtype → its gradient summed over chunks, in the parameter's dtype
            leaf: torch.zeros_like(original)
            for leaf, original in ((w, weight), (b, bias))
            if leaf is not None and leaf.requires_grad
        }
        # The hidden rows' gradient in their own dtype: the cast back is exact, as autocast's cast's backward.
        grad_hidden = torch.empty_like(rows, dtype=ctx.hidden_dtype) if need_hidden else None
        n = ctx.chunk_rows
        with torch.enable_grad(), _no_autocast(rows.device.type):
            for i in range(0, rows.shape[0], n):
                part = rows[i : i + n].detach().requires_grad_(need_hidden)
                logp = _chunk_logprobs(part, targets[i : i + n], w, b)
                inputs = ([part] if need_hidden else []) + list(sums)
                grads = list(torch.autograd.grad(logp, inputs, grad_output[i : i + n]))
                if need_hidden:
                    grad_hidden[i : i + n] = grads.pop(0)
                for total, grad in zip(sums.values(), grads, strict=True):
                    total.add_(grad)  # a half-precision chunk gradient is upcast exactly, as autocast's cast would
        return grad_hidden, None, None, sums.get(w), sums.get(b)


def head_logprobs(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """``(N,)`` log-probability of ``targets`` (``(N,)`` token ids) under the head ``(weight, bias)`` applied to
    ``hidden`` (``(N, H)``), differentiable in all three, holding at most ``chunk_rows × V`` logits at a time."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1; got {chunk_rows}")
    return ChunkedHeadLogprobs.apply(hidden, targets, chunk_rows, weight, bias)


def chunkable_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The model's output head if :func:`scoring_head` can score through it: a plain ``nn.Linear`` (FSDP2's
    per-class subclass included, not a peft LoRA layer or a quantized linear, whose ``forward`` differs), of a model
    that returns the head's output as its logits. ``None``: score through the model's logits."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or type(head).forward is not torch.nn.Linear.forward:
        return None
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return head


@contextmanager
def scoring_head(
    head: torch.nn.Linear, kept: torch.Tensor, targets: torch.Tensor, chunk_rows: int
) -> Iterator[list[torch.Tensor]]:
    """Within the block, ``head`` returns the ``(N,)`` chunked log-probs of ``targets`` instead of logits.

    The head receives the kept hidden rows ``(B, K, H)`` (``logits_to_keep``); ``kept`` (``(N,)`` long) picks the
    scored ones of its flattened ``B·K`` rows, in order, and ``targets`` (``(N,)``) are their tokens. ``head.weight``
    and ``head.bias`` are read at call time: under FSDP2 or ZeRO-3 they are the gathered tensors then. Yields the
    list the head appends its output to, so the caller can check the model returned it unchanged
    (:func:`returned_unchanged`).
    """
    produced: list[torch.Tensor] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.flatten(0, -2).index_select(0, kept.to(hidden.device))
        logp = head_logprobs(rows, targets.to(hidden.device), head.weight, head.bias, chunk_rows)
        produced.append(logp)
        return logp

    head.forward = forward  # an instance attribute: module hooks (FSDP, ZeRO-3) still run around it
    try:
        yield produced
    finally:
        del head.forward


def returned_unchanged(returned: torch.Tensor, produced: list[torch.Tensor]) -> bool:
    """Whether the model's ``logits`` are the scoring head's one output (or a view of it: ZeRO-3 returns a detached
    alias that carries its backward hooks), not something computed from it."""
    if len(produced) != 1 or returned.shape != produced[0].shape or returned.dtype != produced[0].dtype:
        return False
    return returned.untyped_storage()._cdata == produced[0].untyped_storage()._cdata


def _chunk_logprobs(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # upcast half precision, as every RL trainer
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs a matmul in on ``device_type`` now, or ``None`` when autocast is off (or has no such
    device, as ``meta``)."""
    if not torch.amp.is_autocast_available(device_type) or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _no_autocast(device_type: str) -> AbstractContextManager:
    """Autocast off on ``device_type``: the chunk's casts are explicit."""
    if not torch.amp.is_autocast_available(device_type):
        return nullcontext()
    return torch.autocast(device_type, enabled=False)


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``tensor`` as autocast hands it to a lower-precision op: floating tensors but float64 cast to ``dtype``."""
    if tensor is None or dtype is None or not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(dtype)
