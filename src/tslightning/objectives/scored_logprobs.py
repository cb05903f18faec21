"""Log-probabilities of the scored action tokens under the policy: log π_θ(a_t | h_t) for t in M (Eqs. 4, 8).

The learner never re-tokenizes: it consumes the engine's token ids and recomputes the full causal context
of each source (the context-recompute learner; the boundary-adjoint version replaces it later).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def scored_logprobs(model: torch.nn.Module, token_ids: torch.Tensor, scored_mask: torch.Tensor) -> torch.Tensor:
    """``(|M|,)`` log π_θ of each scored token of one sequence, in position order, differentiable in θ.

    Args:
        model: A causal LM returning ``.logits`` of shape ``(1, T, V)``.
        token_ids: ``(T,)`` token ids (context and actions).
        scored_mask: ``(T,)`` bool, True on the tokens to score; position 0 is never scored.
    """
    device = _device_of(model)
    ids = token_ids.to(device=device, dtype=torch.long)
    logits = model(input_ids=ids[None]).logits[0, :-1]
    return _gather(logits, ids[1:], scored_mask[1:].to(device))


def batched_scored_logprobs(
    model: torch.nn.Module, sequences: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], pad_id: int = 0
) -> list[torch.Tensor]:
    """The batch-synchronous form: one right-padded forward over all sequences.

    Returns one ``(|M_i|,)`` tensor per sequence, each equal (up to kernel rounding) to :func:`scored_logprobs`.
    """
    device = _device_of(model)
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(sequences), longest), dtype=torch.long, device=device)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq.to(device)
        attention[row, : len(seq)] = 1
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    return [
        _gather(logits[row, : len(seq) - 1], ids[row, 1 : len(seq)], mask[1:].to(device))
        for row, (seq, mask) in enumerate(zip(sequences, masks, strict=True))
    ]


def _gather(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # Half-precision logits are upcast (as every RL trainer does); float32/float64 stay as they are.
    logits = logits[mask].to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[mask][:, None])[:, 0]


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
