"""Boundary-adjoint context backward (App. I): each causal context is forwarded and back-propagated once.

The context-recompute learner (:mod:`tslightning.objectives.scored_logprobs`) runs every source over its whole
``token_ids``: a GRPO group's prompt m times, an OPD trajectory's history once per turn. Here a context is cut at a
*boundary*: the per-layer key/value states of the tokens before it. A later segment is forwarded from those states, fed
in as detached leaves that require grad, so its backward stops at the boundary and yields, besides its parameter
gradient, the *adjoint* of the boundary states. The adjoints are summed and pushed back through the retained
context graph once, when the context is closed. By linearity of the backward pass this is exactly the gradient
the recompute learner takes (float64 tests: ≤ 1e-10 relative error).

* GRPO, shared prefix (App. I, Implementation 1): :class:`SharedPromptBackward`. A group's prompt runs once;
  each trajectory's continuation gives the continuation part of H_i (folded into G1/G2 of Eq. 7 as before) and a
  prompt adjoint adj_i. Two adjoint sums mirror Eq. 7: A1 = Σ (r_i − c) adj_i and A0 = Σ adj_i (c the group's first
  reward). At group close the prompt is back-propagated once with (a_G / m)(A1 − (μ_G − c) A0), which is the prompt
  part of g_G = (a_G / m) Σ_i (r_i − μ_G) H_i.
* OPD, turn boundaries (App. I, Implementation 2): :class:`TurnBoundaryBackward`. Turn j's ``token_ids`` extend turn
  j−1's; turn j runs from turn j−1's states, its backward (Eq. 8) stops there, and the deferred adjoints are replayed
  through the earlier turns' graphs, last to first, when the trajectory closes (before the N_k normalization).

Cut rule. A segment's first query token is the token *before* its first scored token at the latest (the logit at
position t predicts token t+1), so every scored log-probability comes from the segment's own pass: a GRPO group is
cut at ``prompt_length − 1`` (the prompt's last token is re-run with each continuation), an OPD turn at
``min(previous turn's length, first scored position − 1)``. Positions continue from the boundary (RoPE sees the
same absolute positions as a full-sequence forward).

Every pass runs at the learner's fixed snapshot θ_k: parameters must not change between a context's forward and
its deferred backward (autograd refuses if they were modified in place). The model must use full attention in every
layer (no sliding window), so cached states are exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch
from transformers import DynamicCache

from tslightning.core.contribution import BATCH, Contribution
from tslightning.core.group_accumulator import GroupReduction
from tslightning.core.sources import SourceError, TrajectorySource, TurnSource
from tslightning.measure.learner_flops import BoundaryPass, BoundaryWork
from tslightning.objectives.chunked_head import DEFAULT_CHUNK_ROWS
from tslightning.objectives.scored_logprobs import ScoredRows, policy_logprobs


class ContextBackward(StrEnum):
    """How a source's gradient reaches its causal context (App. I, shared-prefix backward)."""

    RECOMPUTE = "recompute"
    """Every source forwards and back-propagates its whole ``token_ids``."""
    BOUNDARY = "boundary"
    """Each context runs once; later segments' boundary adjoints are back-propagated through it when it closes."""


class BoundaryStates:
    """The per-layer key/value states of a context as one flat list ``[K_0, V_0, K_1, V_1, ...]``.

    Each tensor has shape ``(1, num_kv_heads, tokens, head_dim)`` (keys after RoPE), exactly as the transformers
    :class:`~transformers.DynamicCache` holds them.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)

    @classmethod
    def of_cache(cls, cache: DynamicCache) -> BoundaryStates:
        return cls([t for layer in cache.layers for t in (layer.keys, layer.values)])

    @property
    def length(self) -> int:
        return self.tensors[0].shape[-2] if self.tensors else 0

    def prefix(self, length: int) -> list[torch.Tensor]:
        """States of the first ``length`` tokens, still attached to the graph that produced them."""
        return [t[..., :length, :] for t in self.tensors]

    def leaves(self, length: int) -> list[torch.Tensor]:
        """Detached views of the first ``length`` tokens' states that require grad: a later segment's boundary."""
        return [t.detach().requires_grad_() for t in self.prefix(length)] if length > 0 else []

    def cache(self) -> DynamicCache:
        """A fresh cache holding these states, for a forward that continues after them."""
        pairs = [(self.tensors[i], self.tensors[i + 1]) for i in range(0, len(self.tensors), 2)]
        return DynamicCache(ddp_cache_data=pairs) if pairs else DynamicCache()


def forward_segment(
    policy: torch.nn.Module,
    token_ids: torch.Tensor,
    start: int,
    boundary: Sequence[torch.Tensor],
    scored_mask: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_ROWS,
) -> tuple[torch.Tensor | None, BoundaryStates]:
    """Forward tokens ``[start, T)`` of ``token_ids`` after the ``start`` tokens whose K/V are ``boundary``.

    LoRA adapters (peft) live inside the decoder's linear layers, so ``policy.get_decoder()`` runs them too.

    Returns:
        ``(|M|,)`` log π of the tokens ``scored_mask`` scores (every scored position ``> start``: the logit at
        position t scores token t+1), through the chunked head (:mod:`tslightning.objectives.scored_logprobs`), or
        ``None`` when ``scored_mask`` is None and only the decoder runs; and the states of all T tokens (boundary
        first), attached to this pass's graph.
    """
    device = next(policy.parameters()).device
    ids = token_ids[start:].to(device=device, dtype=torch.long)[None]
    cache = BoundaryStates(boundary).cache()
    positions = torch.arange(start, start + ids.shape[1], device=device)[None]  # RoPE continues after the boundary
    inputs = {"input_ids": ids, "past_key_values": cache, "position_ids": positions, "use_cache": True}
    if scored_mask is None:
        policy.get_decoder()(**inputs)
        return None, BoundaryStates.of_cache(cache)
    (logp,), _ = policy_logprobs(policy, ScoredRows.of([token_ids], [scored_mask], start), chunk_tokens, **inputs)
    return logp, BoundaryStates.of_cache(cache)


def check_full_attention(policy: torch.nn.Module) -> None:
    """Raise ``ValueError`` unless every layer of ``policy`` attends to the whole context (cached states are exact)."""
    config = policy.config.get_text_config() if hasattr(policy.config, "get_text_config") else policy.config
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"} or getattr(config, "use_sliding_window", False):
        raise ValueError(
            f"the boundary-adjoint context backward needs full attention in every layer; this model has {sorted(kinds)}"
            " (use context_backward='recompute')"
        )


def _first_scored(scored_mask: torch.Tensor) -> int:
    """Position of the first scored token (the mask scores at least one, never position 0)."""
    return int(torch.nonzero(scored_mask)[0, 0])


Backward = Callable[..., list[torch.Tensor]]
"""``backward(outputs, contribution, inputs, grad_outputs, retain_graph)``: back-propagate ``outputs``, fold the
trainable parameters' gradient into ``contribution``'s statistics unit by unit
(:meth:`~tslightning.distributed.parameter_placement.ParameterPlacement.backward`), return the gradients of
``inputs``."""


class _GradientSplitter:
    """A backward over the trainable parameters and some boundary leaves. With a :data:`Backward` the parameters'
    gradient is folded as it is produced (nothing returned for them); without one it is returned, per parameter
    (unused ones as zeros), as ``torch.autograd.grad`` gives it."""

    def __init__(self, parameters: Sequence[torch.nn.Parameter], backward: Backward | None = None) -> None:
        self.parameters = list(parameters)
        self.backward = backward

    def __call__(
        self,
        outputs: Sequence[torch.Tensor],
        leaves: Sequence[torch.Tensor],
        grad_outputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
        contribution: Contribution = BATCH,
    ) -> tuple[list[torch.Tensor] | None, list[torch.Tensor]]:
        if self.backward is not None:
            return None, self.backward(outputs, contribution, leaves, grad_outputs, retain_graph)
        # A state computed from frozen weights only (e.g. layer 0's keys under LoRA) carries no gradient to anything.
        kept = [i for i, x in enumerate(outputs) if x.requires_grad]
        grads = (None,) * (len(self.parameters) + len(leaves))
        if kept:
            grads = torch.autograd.grad(
                [outputs[i] for i in kept],
                self.parameters + list(leaves),
                grad_outputs=None if grad_outputs is None else [grad_outputs[i] for i in kept],
                retain_graph=retain_graph,
                allow_unused=True,
            )
        n = len(self.parameters)
        params = [torch.zeros_like(p) if g is None else g for p, g in zip(self.parameters, grads[:n], strict=True)]
        adjoints = [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads[n:], strict=True)]
        return params, adjoints


# ----------------------------------------------------------------- GRPO: shared-prefix backward
@dataclass
class _OpenPrompt:
    prefix: torch.Tensor  # (c,) token ids before the group's boundary
    states: BoundaryStates  # K/V of the prefix, graph alive until the group closes
    leaves: list[torch.Tensor]  # what every continuation reads (detached, requires grad)
    weighted: list[torch.Tensor]  # A1 = Σ (r_i − c) adj_i
    unweighted: list[torch.Tensor]  # A0 = Σ adj_i
    shift: float = 0.0  # c of Eq. 7's shifted statistic: the first reward folded in
    num_sources: int = 0


class SharedPromptBackward:
    """GRPO shared-prefix backward (App. I): one prompt forward and backward per group instead of m.

    Contract, for a group of m trajectories at the fixed snapshot θ_k with token weights w_i = 1/(P·L_i):

    * :meth:`admit` validates a trajectory against its group's prompt before the caller records it.
    * :meth:`source_gradient` returns the continuation part of H_i = ∇ S_i (per-parameter tensors, the
      parameters' shapes and dtype; with a ``backward``, folded into the trajectory's contribution instead) — fold it
      into G1/G2 exactly as a recompute H_i (Eq. 7) — and adds the
      prompt adjoint adj_i = ∂S_i/∂(prompt K/V) to the group's A1 = Σ (r_i − c) adj_i and A0 = Σ adj_i. The group's
      first call forwards the prompt and keeps its graph.
    * :meth:`close_group` returns J_promptᵀ (a_G / m)(A1 − (μ_G − c) A0), the prompt part of g_G (Eq. 7), to add to the
      batch direction (with a ``backward``, folded into the batch accumulator); ``None`` for a uniform-reward group
      (a_G = 0), a one-token prompt (nothing to share), or when folded.

    The prompt is the first admitted trajectory's ``prompt_length`` tokens; the boundary is one token earlier (see
    the module docstring). Memory per open group: the prompt's retained graph and two adjoint sums shaped like the
    prompt's K/V (2·num_layers tensors of ``(1, num_kv_heads, prompt_length − 1, head_dim)``).

    Args:
        policy: The causal LM (transformers, optionally peft-wrapped) with full attention in every layer.
        parameters: The trainable parameters, in the order of
            :class:`~tslightning.core.parameter_layout.ParameterLayout`.
        dtype: dtype of the adjoint sums; default the states' dtype promoted to float32.
        backward: Folds the parameters' gradient of every pass as it is produced (:data:`Backward`); ``None``:
            return it instead.
        chunk_tokens: Most rows of logits the output head holds at a time.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        parameters: Sequence[torch.nn.Parameter],
        dtype: torch.dtype | None = None,
        backward: Backward | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        check_full_attention(policy)
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self.dtype = dtype
        self._grad = _GradientSplitter(parameters, backward)
        self._prefixes: dict[str, torch.Tensor] = {}  # group id → tokens before its boundary, from the first admit
        self._open: dict[str, _OpenPrompt] = {}
        self.passes: list[BoundaryPass] = []
        """Passes run since the last :meth:`reset`, for :func:`~tslightning.measure.learner_flops.boundary_flops`."""

    @property
    def open_groups(self) -> list[str]:
        """Groups whose prompt graph is held."""
        return list(self._open)

    def admit(self, source: TrajectorySource) -> None:
        """Check that ``source`` extends its group's prompt; the first trajectory of a group defines it.

        Raises:
            SourceError: if its first ``prompt_length − 1`` tokens differ from the group's, it scores one of them, or
                it has several sequences (an agent harness rewrote its history: only the group's prompt is shared).
        """
        if source.segments:
            raise SourceError(
                f"TrajectorySource ({source.group_id!r}, {source.trajectory_index}) has several sequences (its harness "
                "rewrote its history); context_backward='boundary' shares one prompt per group: use 'recompute'"
            )
        prefix = self._prefixes.get(source.group_id)
        if prefix is None:
            self._prefixes[source.group_id] = source.token_ids[: source.prompt_length - 1].clone()
            return
        cut = prefix.numel()
        where = f"TrajectorySource ({source.group_id!r}, {source.trajectory_index})"
        if source.token_ids.numel() <= cut or not torch.equal(source.token_ids[:cut], prefix):
            raise SourceError(
                f"{where} does not start with its group's shared prompt (the first {cut} tokens of the group's first "
                "trajectory); every trajectory of a group must extend the same prompt token ids"
            )
        if _first_scored(source.scored_mask) <= cut:
            raise SourceError(
                f"{where} scores token {_first_scored(source.scored_mask)}, inside its group's shared prompt "
                f"(tokens [0, {cut + 1})); only tokens after the prompt can be scored"
            )

    def source_gradient(
        self, source: TrajectorySource, weight: float, contribution: Contribution = BATCH
    ) -> list[torch.Tensor] | None:
        """The continuation part of ``weight``·∇ Σ_{t∈M_i} log π_θ(a_t|h_t) for an admitted trajectory (folded into
        ``contribution`` when there is a ``backward``)."""
        prompt = self._open.get(source.group_id) or self._open_prompt(source.group_id)
        start = prompt.prefix.numel()
        logp, _ = forward_segment(
            self.policy, source.token_ids, start, prompt.leaves, source.scored_mask, self.chunk_tokens
        )
        self.passes.append(
            BoundaryPass(BoundaryWork.CONTINUATION, source.token_ids.numel() - start, start, logp.numel())
        )
        score = logp.sum() * weight
        params, adjoints = self._grad([score], prompt.leaves, contribution=contribution)
        if prompt.num_sources == 0:
            prompt.shift = source.reward
        for a1, a0, adj in zip(prompt.weighted, prompt.unweighted, adjoints, strict=True):
            a1.add_(adj.to(a1.dtype), alpha=source.reward - prompt.shift)
            a0.add_(adj.to(a0.dtype))
        prompt.num_sources += 1
        return params

    def close_group(self, reduction: GroupReduction) -> list[torch.Tensor] | None:
        """Back-propagate the group's combined prompt adjoint once and free the prompt graph.

        Args:
            reduction: The group's reduction from :meth:`GroupAccumulator.close` (rewards, μ_G and a_G).
        """
        prompt = self._open.pop(reduction.group_id)
        del self._prefixes[reduction.group_id]
        if prompt.num_sources != len(reduction.rewards):
            raise RuntimeError(
                f"group {reduction.group_id!r} closed with {prompt.num_sources} continuations but "
                f"{len(reduction.rewards)} rewards"
            )
        if reduction.uniform or not prompt.leaves:
            return None
        alpha = reduction.scale / len(reduction.rewards)
        beta = -alpha * (reduction.mean - prompt.shift)
        combined = [  # (a_G/m)·A1 − (a_G/m)(μ − c)·A0, float64 coefficients applied once (as GroupAccumulator)
            (a1 * alpha + a0 * beta).to(state.dtype)
            for a1, a0, state in zip(prompt.weighted, prompt.unweighted, prompt.states.tensors, strict=True)
        ]
        self.passes.append(BoundaryPass(BoundaryWork.DEFERRED_BACKWARD, prompt.prefix.numel()))
        params, _ = self._grad(prompt.states.tensors, [], grad_outputs=combined)
        return params

    def reset(self) -> None:
        """Drop every open group (a new logical batch, or an aborted one) and the pass ledger."""
        self._prefixes.clear()
        self._open.clear()
        self.passes = []

    def _open_prompt(self, group_id: str) -> _OpenPrompt:
        prefix = self._prefixes[group_id]
        cut = prefix.numel()
        states = BoundaryStates([])
        if cut > 0:
            _, states = forward_segment(self.policy, prefix, 0, [])
            self.passes.append(BoundaryPass(BoundaryWork.PREFIX_FORWARD, cut))
        leaves = states.leaves(cut)
        dtype = self.dtype or (torch.promote_types(leaves[0].dtype, torch.float32) if leaves else None)
        zeros = [torch.zeros_like(x, dtype=dtype) for x in leaves]
        prompt = _OpenPrompt(prefix, states, leaves, zeros, [z.clone() for z in zeros])
        self._open[group_id] = prompt
        return prompt


# ----------------------------------------------------------------- OPD: turn boundaries
@dataclass
class _Turn:
    token_ids: torch.Tensor  # the turn's whole history
    start: int  # its boundary: tokens [0, start) were forwarded by earlier turns
    states: BoundaryStates  # K/V of all its tokens, graph alive until the trajectory closes
    leaves: list[torch.Tensor]  # the boundary K/V it read (detached, requires grad)
    adjoint: list[torch.Tensor]  # ∂(own loss + later turns' losses)/∂ leaves, complete once later turns replayed


@dataclass
class _OpenTrajectory:
    turns: list[_Turn] = field(default_factory=list)  # run, in turn order
    waiting: dict[int, TurnSource] = field(default_factory=dict)  # admitted, not run: a predecessor is missing
    histories: dict[int, torch.Tensor] = field(default_factory=dict)  # every admitted turn's token_ids


class TurnBoundaryBackward:
    """OPD turn-boundary backward (App. I, Implementation 2): a trajectory's history is forwarded once, not per turn.

    Contract, for each trajectory at the fixed snapshot θ_k:

    * :meth:`admit` validates a :class:`~tslightning.core.sources.TurnSource` against its admitted neighbours and
      returns the turns that can run now, in turn order: turn j needs turn j−1's states, so a turn that arrives
      before its predecessor waits for it.
    * :meth:`turn_gradient` returns the part of g_j = Σ_t A_{j,t} ∇ log π_θ(a_{j,t}|h_{j,t}) (Eq. 8, A detached, not
      yet divided by N_k) that flows through turn j's own tokens, as per-parameter tensors; the adjoint at its
      boundary (the K/V of the history it continues) is kept.
    * :meth:`close_trajectory` replays the kept adjoints through the earlier turns' graphs, last to first, and
      returns their parameter gradient (per-parameter tensors in ``dtype``): together with every
      :meth:`turn_gradient` this is exactly Σ_j g_j of the recompute learner.

    Memory per open trajectory: every run turn's graph up to its K/V outputs (the LM head's part is freed).

    Args:
        policy: The causal LM (transformers, optionally peft-wrapped) with full attention in every layer.
        parameters: The trainable parameters, in the order of
            :class:`~tslightning.core.parameter_layout.ParameterLayout`.
        dtype: dtype of the summed replay gradient; default the parameters' dtype promoted to float32.
        backward: Folds every pass's parameter gradient into the batch accumulator as it is produced
            (:data:`Backward`); ``None``: return it instead.
        chunk_tokens: Most rows of logits the output head holds at a time.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        parameters: Sequence[torch.nn.Parameter],
        dtype: torch.dtype | None = None,
        backward: Backward | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        check_full_attention(policy)
        self.policy = policy
        self.chunk_tokens = chunk_tokens
        self._grad = _GradientSplitter(parameters, backward)
        self.dtype = dtype or torch.promote_types(self._grad.parameters[0].dtype, torch.float32)
        self._open: dict[tuple[str, int], _OpenTrajectory] = {}
        self.passes: list[BoundaryPass] = []
        """Passes run since the last :meth:`reset`, for :func:`~tslightning.measure.learner_flops.boundary_flops`."""

    @property
    def open_trajectories(self) -> list[tuple[str, int]]:
        """Trajectories whose turn graphs are held."""
        return list(self._open)

    def admit(self, source: TurnSource) -> list[TurnSource]:
        """Accept a turn; return the turns of its trajectory that can run now, in order (possibly none).

        Raises:
            SourceError: if the turn's ``token_ids`` do not extend the previous turn's, or the next turn's do not
                extend its own (whichever of them has been admitted); nothing changes then.
        """
        trajectory = self._open.get((source.group_id, source.trajectory_index)) or _OpenTrajectory()
        j = source.turn_index
        if j in trajectory.histories:
            raise SourceError(f"{_where(source)} was admitted twice")
        if j - 1 in trajectory.histories:
            _check_extends(source, trajectory.histories[j - 1])
        if j + 1 in trajectory.histories:
            _check_extends(trajectory.waiting[j + 1], source.token_ids)
        trajectory.histories[j] = source.token_ids
        self._open[(source.group_id, source.trajectory_index)] = trajectory
        trajectory.waiting[j] = source
        ready = []
        while len(trajectory.turns) + len(ready) in trajectory.waiting:
            ready.append(trajectory.waiting.pop(len(trajectory.turns) + len(ready)))
        return ready

    def turn_gradient(self, source: TurnSource) -> list[torch.Tensor] | None:
        """Turn j's own-pass part of its unnormalized g_j (Eq. 8), for the turns :meth:`admit` returned, in order."""
        trajectory = self._open[(source.group_id, source.trajectory_index)]
        if source.turn_index != len(trajectory.turns):
            raise RuntimeError(f"{_where(source)} run before turn {len(trajectory.turns)}; run what admit() returns")
        previous = trajectory.turns[-1] if trajectory.turns else None
        start = 0
        if previous is not None:  # after the previous history, or earlier if a scored token needs its last logit
            start = min(previous.token_ids.numel(), _first_scored(source.scored_mask) - 1)
        leaves = [] if previous is None else previous.states.leaves(start)
        logp, states = forward_segment(
            self.policy, source.token_ids, start, leaves, source.scored_mask, self.chunk_tokens
        )
        self.passes.append(
            BoundaryPass(BoundaryWork.CONTINUATION, source.token_ids.numel() - start, start, logp.numel())
        )
        advantage = source.teacher_logprobs.to(logp) - logp.detach()
        # Keep the graph: later turns' adjoints are replayed through this turn's states.
        params, adjoint = self._grad([(advantage * logp).sum()], leaves, retain_graph=True)
        trajectory.turns.append(_Turn(source.token_ids, start, states, leaves, adjoint))
        return params

    def close_trajectory(self, group_id: str, trajectory_index: int) -> list[torch.Tensor] | None:
        """Replay the deferred boundary adjoints through earlier turns, last to first, and free the trajectory;
        returns their parameter gradient (``None`` when a ``backward`` folded each replay into the batch)."""
        trajectory = self._open.pop((group_id, trajectory_index))
        if trajectory.waiting:
            raise RuntimeError(
                f"trajectory ({group_id!r}, {trajectory_index}) closed with turns {sorted(trajectory.waiting)} waiting "
                f"for turn {len(trajectory.turns)}"
            )
        folding = self._grad.backward is not None
        total = None if folding else [torch.zeros_like(p, dtype=self.dtype) for p in self._grad.parameters]
        turns = trajectory.turns
        while len(turns) > 1:
            later = turns.pop()  # its adjoint is complete: every turn after it has been replayed
            earlier = turns[-1]
            if later.start == 0:
                continue
            params, adjoint = self._grad(earlier.states.prefix(later.start), earlier.leaves, later.adjoint)
            self.passes.append(
                BoundaryPass(BoundaryWork.DEFERRED_BACKWARD, earlier.token_ids.numel() - earlier.start, earlier.start)
            )
            for t, g in zip(total or (), params or (), strict=True):
                t.add_(g.to(t.dtype))
            for a, g in zip(earlier.adjoint, adjoint, strict=True):
                a.add_(g)
        return total

    def reset(self) -> None:
        """Drop every open trajectory (a new logical batch, or an aborted one) and the pass ledger."""
        self._open.clear()
        self.passes = []


def _where(source: TurnSource) -> str:
    return f"TurnSource ({source.group_id!r}, {source.trajectory_index}, turn {source.turn_index})"


def _check_extends(source: TurnSource, history: torch.Tensor) -> None:
    """Raise :class:`SourceError` unless ``source.token_ids`` is ``history`` followed by at least one token."""
    ids, length = source.token_ids, history.numel()
    if ids.numel() > length and torch.equal(ids[:length], history):
        return
    overlap = min(length, ids.numel())
    same = ids[:overlap] == history[:overlap]
    differs = int(torch.nonzero(~same)[0, 0]) if not bool(same.all()) else overlap
    raise SourceError(
        f"{_where(source)}.token_ids ({ids.numel()} tokens) does not extend the previous turn's {length} tokens "
        f"(first difference at position {differs}); each turn's token_ids must be the previous turn's history "
        "followed by new tokens"
    )
