"""Log-probabilities of the scored action tokens under the policy: log π_θ(a_t | h_t) for t in M (Eqs. 4, 8).

The learner never re-tokenizes: it consumes the engine's token ids and recomputes the full causal context
of each source (the context-recompute learner; the boundary-adjoint version replaces it later).

No pass builds T×V logits. Only the positions whose next token is scored reach the output head (the model's own
``logits_to_keep``), and the head scores them in chunks of at most ``chunk_tokens`` rows inside the model's forward
(:mod:`tslightning.objectives.chunked_head`), so what the model returns as ``logits`` is already the ``(|M|,)``
log-probs. A head that is not a plain linear layer (a LoRA-adapted or quantized head), or a model that transforms
its head's output (logit soft-capping or scaling), is scored through its returned logits of the scored rows
instead: ``|M| × V`` of them, never ``T × V``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tslightning.objectives.chunked_head import DEFAULT_CHUNK_ROWS, chunkable_head, returned_unchanged, scoring_head

__all__ = ["DEFAULT_CHUNK_ROWS", "ScoredRows", "batched_scored_logprobs", "checked_chunk_tokens", "scored_logprobs"]


@dataclass(frozen=True)
class ScoredRows:
    """Which rows of a pass's hidden states are scored, and by which tokens (host tensors).

    Attributes:
        positions: ``(K,)`` input positions whose logit scores the next token, in any sequence of the pass (sorted):
            the model's ``logits_to_keep``.
        kept: ``(N,)`` indices into the head's flattened ``B·K`` rows of those actually scored, sequence by sequence
            in position order.
        targets: ``(N,)`` the token each kept row scores.
        counts: Scored tokens per sequence (they sum to N).
    """

    positions: torch.Tensor
    kept: torch.Tensor
    targets: torch.Tensor
    counts: tuple[int, ...]

    @classmethod
    def of(cls, sequences: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], start: int = 0) -> ScoredRows:
        """The rows scoring each ``masks[b]``'s tokens of ``sequences[b]`` in a pass over ``sequences[b][start:]``:
        the logit at input position p scores token ``start + p + 1``; position ``start`` is never scored."""
        scored = [torch.nonzero(mask[start + 1 :].cpu())[:, 0] for mask in masks]
        positions = torch.unique(torch.cat(scored)) if scored else torch.zeros(0, dtype=torch.long)
        kept, targets = [], []
        for row, (ids, rows) in enumerate(zip(sequences, scored, strict=True)):
            kept.append(row * positions.numel() + torch.searchsorted(positions, rows))
            targets.append(ids[start + 1 :].cpu()[rows].long())
        return cls(positions, torch.cat(kept), torch.cat(targets), tuple(int(r.numel()) for r in scored))


def scored_logprobs(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    scored_mask: torch.Tensor,
    chunk_tokens: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """``(|M|,)`` log π_θ of each scored token of one sequence, in position order, differentiable in θ.

    Args:
        model: A transformers causal LM (optionally peft-wrapped) that accepts ``logits_to_keep``.
        token_ids: ``(T,)`` token ids (context and actions).
        scored_mask: ``(T,)`` bool, True on the tokens to score; position 0 is never scored.
        chunk_tokens: Most rows of logits the output head holds at a time.
    """
    ids = token_ids.to(device=_device_of(model), dtype=torch.long)[None]
    rows = ScoredRows.of([token_ids], [scored_mask])
    (logp,), _ = policy_logprobs(model, rows, chunk_tokens, input_ids=ids, use_cache=False)
    return logp


def batched_scored_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    pad_id: int = 0,
    chunk_tokens: int = DEFAULT_CHUNK_ROWS,
) -> list[torch.Tensor]:
    """The batch-synchronous form: one right-padded forward over all sequences.

    Returns one ``(|M_i|,)`` tensor per sequence, each equal (up to kernel rounding) to :func:`scored_logprobs`.
    The head sees the union of the sequences' scored positions and scores only each sequence's own.
    """
    device = _device_of(model)
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long, device=device)
    attention = torch.zeros((len(sequences), longest), dtype=torch.long, device=device)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = seq.to(device)
        attention[row, : len(seq)] = 1
    rows = ScoredRows.of(sequences, masks)
    logps, _ = policy_logprobs(model, rows, chunk_tokens, input_ids=ids, attention_mask=attention, use_cache=False)
    return list(logps)


def checked_chunk_tokens(value: int, name: str = "logprob_chunk_tokens") -> int:
    """``value`` if it is a valid chunk size (an int >= 1), else ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 (rows of logits per head chunk, e.g. 1024); got {value!r}")
    return value


def policy_logprobs(
    model: torch.nn.Module, rows: ScoredRows, chunk_tokens: int, **inputs: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """One forward of ``model(**inputs)`` scoring ``rows``: the log-probs of each sequence (``rows.counts`` long,
    float32 for half-precision models) and the model's output (its ``logits`` are the flat log-probs).

    Raises:
        RuntimeError: if the model returned something computed from its head's output as ``logits`` (a logit
            transform this module does not know; see :data:`~tslightning.objectives.chunked_head._LOGIT_TRANSFORMS`).
    """
    device = _device_of(model)
    positions = rows.positions.to(device)
    head = chunkable_head(model)
    if head is None:  # the head's logits of the scored rows, as the model returns them
        output = model(**inputs, logits_to_keep=positions)
        logits = output.logits.flatten(0, -2).index_select(0, rows.kept.to(device))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # upcast half precision
        logp = torch.log_softmax(logits, dim=-1).gather(-1, rows.targets.to(device)[:, None])[:, 0]
        return logp.split(rows.counts), output
    with scoring_head(head, rows.kept, rows.targets, chunk_tokens) as produced:
        output = model(**inputs, logits_to_keep=positions)
    if not returned_unchanged(output.logits, produced):
        raise RuntimeError(
            f"{type(model).__name__} returned logits computed from its output head's result, which the chunked "
            "scorer replaced by log-probs; tslightning knows no such transform for this model"
        )
    return output.logits.split(rows.counts), output


def _device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
