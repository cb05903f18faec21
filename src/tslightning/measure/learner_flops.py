"""Learner model FLOPs of one source, counted from the architecture and the actual token count (App. B.1).

Eq. 10's numerator F_k^train is the model FLOPs the learner needs for update k. App. B.1's operator accounting:

* a matrix product (m × k)(k × n) is credited 2·m·k·n FLOPs, so a linear layer over T tokens costs 2·T·d_in·d_out
  forward;
* backward adds one such product for the input gradient wherever gradients propagate through the layer, and one for
  the weight gradient when the weight is trained — 2× forward for a trained layer. A frozen LoRA base keeps the
  input-gradient product and drops the weight-gradient one; the rank-r adapter's products are counted separately;
* the ledger sums attention projections, query-key and attention-value products and the vocabulary projection with
  their *actual tensor shapes*: every context token counts (loss mask or not), and the score product of a sequence of
  T tokens is the full (T × d_head)(d_head × T) product — not the causal half — since that is the shape the product
  has (App. B.1: "using their actual tensor shapes"), and the same count ``torch.utils.flop_counter`` (hence
  Lightning's :func:`~lightning.fabric.utilities.throughput.measure_flops`) gives for attention;
* activation-checkpoint recomputation is not credited, nor is the chunked head's recomputation of its logits in the
  backward (:mod:`tslightning.objectives.chunked_head`); norms, activations, softmax and embedding lookups are not
  matrix products and are not counted.

The learner recomputes each source's full causal context (:mod:`tslightning.objectives.scored_logprobs`) and its
head computes logits at the scored positions only, so a source of T tokens with |M| scored costs :func:`source_flops`
``(shape, T, training, |M|)`` (without ``scored_tokens``: logits at every position, as a plain ``model(ids).logits``
computes them). The boundary-adjoint context backward (App. I) runs each context once instead; its passes are counted
by :func:`boundary_flops`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType

import torch

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = (*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, "lm_head")
"""The matrix-product weights of a dense (Llama/Qwen-style) decoder, by their transformers module names."""

_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def matmul_flops(m: int, k: int, n: int) -> int:
    """FLOPs credited to one (m × k)(k × n) matrix product: 2·m·k·n (App. B.1)."""
    return 2 * m * k * n


@dataclass(frozen=True)
class FlopCount:
    """Forward and backward model FLOPs (recomputation excluded)."""

    forward: int = 0
    backward: int = 0

    @property
    def total(self) -> int:
        return self.forward + self.backward

    def __add__(self, other: FlopCount) -> FlopCount:
        return FlopCount(self.forward + other.forward, self.backward + other.backward)

    def __mul__(self, times: int) -> FlopCount:
        return FlopCount(self.forward * times, self.backward * times)


@dataclass(frozen=True)
class DecoderShape:
    """The shapes of a dense decoder-only LM that determine its matmul FLOPs.

    Attributes:
        hidden_size: Width d of the residual stream.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention shrinks only the K/V projections).
        head_dim: Width of one attention head.
        intermediate_size: Width of the gated (SwiGLU) MLP.
        vocab_size: Rows of the LM head.
        tie_word_embeddings: Whether the LM head shares the input embedding matrix (its product runs either way; a
            trained tied head also trains the embeddings, so gradients reach the first layer's input).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False

    @classmethod
    def from_config(cls, config) -> DecoderShape:
        """Read the shape from a ``transformers`` config (the text config of a multimodal one).

        Raises:
            ValueError: for a mixture-of-experts config, whose routed products depend on the tokens dispatched to
                each expert (App. B.1) rather than on the architecture alone.
        """
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        moe = {k: getattr(config, k) for k in _MOE_KEYS if getattr(config, k, None)}
        if moe:
            raise ValueError(
                f"learner_flops counts dense decoders; this config has experts ({moe}), whose FLOPs need the tokens "
                "dispatched to each expert (App. B.1)"
            )
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def projection_widths(self, name: str) -> tuple[int, int]:
        """``(d_in, d_out)`` of projection ``name`` (one of :data:`PROJECTIONS`)."""
        d, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        widths = {
            "q_proj": (d, q),
            "k_proj": (d, kv),
            "v_proj": (d, kv),
            "o_proj": (q, d),
            "gate_proj": (d, self.intermediate_size),
            "up_proj": (d, self.intermediate_size),
            "down_proj": (self.intermediate_size, d),
            "lm_head": (d, self.vocab_size),
        }
        return widths[name]


@dataclass(frozen=True)
class WeightTraining:
    """Which weights the learner differentiates; it decides which backward products run (App. B.1).

    Attributes:
        trained: Projections (:data:`PROJECTIONS`) whose own weights get gradients.
        adapters: LoRA rank r per adapted projection (adapter weights are always trained).
        embeddings_trained: Whether the input embeddings get gradients; then gradients reach the first layer's input.
        norms_trained: Whether the RMSNorm weights get gradients; then every normalized input carries a gradient.
    """

    trained: frozenset[str] = frozenset(PROJECTIONS)
    adapters: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    embeddings_trained: bool = True
    norms_trained: bool = True

    def __post_init__(self) -> None:
        unknown = (set(self.trained) | set(self.adapters)) - set(PROJECTIONS)
        if unknown:
            raise ValueError(f"WeightTraining names unknown projections {sorted(unknown)}; use those in {PROJECTIONS}")
        bad = {name: r for name, r in self.adapters.items() if not isinstance(r, int) or r < 1}
        if bad:
            raise ValueError(f"WeightTraining.adapters ranks must be ints >= 1; got {bad}")

    @classmethod
    def full(cls) -> WeightTraining:
        """Full fine-tuning: every weight is trained."""
        return cls()

    @classmethod
    def lora(cls, rank: int, targets: tuple[str, ...] = ATTENTION_PROJECTIONS + MLP_PROJECTIONS) -> WeightTraining:
        """A frozen base with rank-``rank`` adapters on ``targets`` (Table 5 uses r = 32 on every linear layer)."""
        return cls(frozenset(), MappingProxyType(dict.fromkeys(targets, rank)), False, False)

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> WeightTraining:
        """Read the split from ``requires_grad`` of a transformers model, optionally wrapped by peft LoRA.

        Raises:
            ValueError: when one projection is trained in some layers and frozen in others, or adapters differ in
                rank across layers (per-layer splits are not modelled).
        """
        trained: dict[str, set[bool]] = {}
        ranks: dict[str, set[int]] = {}
        norms = False
        for name, p in model.named_parameters():
            parts = name.split(".")
            if "lora_A" in parts:
                proj = parts[parts.index("lora_A") - 1]
                if proj in PROJECTIONS and p.requires_grad:
                    ranks.setdefault(proj, set()).add(p.shape[0])
            elif parts[-1] == "weight" and (proj := _projection_of(parts)) is not None:
                trained.setdefault(proj, set()).add(p.requires_grad)
            elif len(parts) >= 2 and "norm" in parts[-2] and p.requires_grad:
                norms = True
        mixed = sorted(k for k, v in {**trained, **ranks}.items() if len(v) > 1)
        if mixed:
            raise ValueError(f"projections {mixed} are trained (or adapted) differently across layers; not modelled")
        # A tied head appears once among named_parameters (as the embedding); ask the model for it.
        head = {"lm_head"} if model.get_output_embeddings().weight.requires_grad else set()
        return cls(
            trained=frozenset({k for k, (flag,) in trained.items() if flag and k != "lm_head"} | head),
            adapters=MappingProxyType({k: next(iter(r)) for k, r in ranks.items()}),
            embeddings_trained=model.get_input_embeddings().weight.requires_grad,
            norms_trained=norms,
        )


def _projection_of(parts: list[str]) -> str | None:
    """The projection a ``...q_proj.weight`` or peft ``...q_proj.base_layer.weight`` parameter belongs to."""
    owner = parts[-3] if len(parts) >= 3 and parts[-2] == "base_layer" else parts[-2] if len(parts) >= 2 else None
    return owner if owner in PROJECTIONS else None


def linear_flops(tokens: int, d_in: int, d_out: int, weight_grad: bool, input_grad: bool) -> FlopCount:
    """One linear layer over ``tokens`` rows: 2·T·d_in·d_out forward; backward adds that per gradient it needs."""
    product = matmul_flops(tokens, d_in, d_out)
    return FlopCount(product, product * (int(weight_grad) + int(input_grad)))


def _projection(
    shape: DecoderShape, training: WeightTraining, name: str, tokens: int, grad_in: bool
) -> tuple[FlopCount, bool]:
    """A projection and its LoRA adapter (y = W x + B A x); returns its FLOPs and whether its output needs grad."""
    d_in, d_out = shape.projection_widths(name)
    trained = name in training.trained
    count = linear_flops(tokens, d_in, d_out, weight_grad=trained, input_grad=grad_in)
    rank = training.adapters.get(name)
    if rank is not None:
        count += linear_flops(tokens, d_in, rank, weight_grad=True, input_grad=grad_in)  # A
        count += linear_flops(tokens, rank, d_out, weight_grad=True, input_grad=True)  # B: A's output needs grad
    return count, grad_in or trained or rank is not None


def _attention_products(shape: DecoderShape, tokens: int, grad_q: bool, grad_k: bool, grad_v: bool) -> FlopCount:
    """Scores Q·Kᵀ and outputs P·V per query head at full (T × T) shape; one backward product per operand needing
    grad (dQ, dK; dP, dV)."""
    product = shape.num_heads * matmul_flops(tokens, shape.head_dim, tokens)
    grad_p = grad_q or grad_k
    backward = product * (int(grad_q) + int(grad_k) + int(grad_p) + int(grad_v))
    return FlopCount(2 * product, backward)


def _layer(shape: DecoderShape, training: WeightTraining, tokens: int, grad_in: bool) -> tuple[FlopCount, bool]:
    """One decoder layer (attention block, then gated MLP), walking gradient requirements forward."""
    normed = grad_in or training.norms_trained
    count, grads = FlopCount(), {}
    for name in ("q_proj", "k_proj", "v_proj"):
        flops, grads[name] = _projection(shape, training, name, tokens, normed)
        count += flops
    count += _attention_products(shape, tokens, grads["q_proj"], grads["k_proj"], grads["v_proj"])
    flops, grad_attn = _projection(shape, training, "o_proj", tokens, any(grads.values()))
    count += flops
    residual = grad_in or grad_attn
    normed = residual or training.norms_trained
    gate, grad_gate = _projection(shape, training, "gate_proj", tokens, normed)
    up, grad_up = _projection(shape, training, "up_proj", tokens, normed)
    down, grad_down = _projection(shape, training, "down_proj", tokens, grad_gate or grad_up)
    return count + gate + up + down, residual or grad_down


def source_flops(
    shape: DecoderShape, tokens: int, training: WeightTraining | None = None, scored_tokens: int | None = None
) -> FlopCount:
    """Forward and backward FLOPs of one source of ``tokens`` tokens (Eq. 10's numerator, App. B.1).

    ``tokens`` is the whole sequence the learner runs — prompt, earlier turns and observations included ("context
    tokens contribute computation even when their loss mask is zero"); the LM head runs over ``scored_tokens`` rows
    (the learner's: only scored positions reach it), or every token when ``None``. Backward counts the weight-gradient
    product of
    trained weights and the input-gradient product wherever gradients propagate, so full fine-tuning gives exactly
    3× forward; with a frozen base (LoRA) the first layer's Q/K/V base products need no backward at all, since
    nothing before them requires a gradient.
    """
    if tokens < 0 or (scored_tokens is not None and not 0 <= scored_tokens <= tokens):
        raise ValueError(f"tokens must be >= 0 and scored_tokens in [0, tokens]; got {tokens}, {scored_tokens}")
    training = training or WeightTraining.full()
    grad = training.embeddings_trained
    count = FlopCount()
    for _ in range(shape.num_layers):
        layer, grad = _layer(shape, training, tokens, grad)
        count += layer
    rows = tokens if scored_tokens is None else scored_tokens
    head, _ = _projection(shape, training, "lm_head", rows, grad or training.norms_trained)
    return count + head


def learner_flops(
    shape: DecoderShape, tokens: int, training: WeightTraining | None = None, scored_tokens: int | None = None
) -> int:
    """Total credited model FLOPs (forward + backward) of one source of ``tokens`` tokens; see :func:`source_flops`."""
    return source_flops(shape, tokens, training, scored_tokens).total


# ----------------------------------------------------------------- boundary-adjoint context backward (App. I)
class BoundaryWork(StrEnum):
    """The kinds of learner pass of the boundary-adjoint context backward
    (:mod:`tslightning.learner.boundary_adjoint`)."""

    PREFIX_FORWARD = "prefix_forward"
    """A GRPO group's shared prompt, forwarded once through the decoder (no LM head, no loss) for its K/V states."""
    CONTINUATION = "continuation"
    """A continuation (GRPO) or turn (OPD): forward from cached boundary K/V, LM head, backward of its loss down to
    the parameters and the boundary K/V."""
    DEFERRED_BACKWARD = "deferred_backward"
    """Backward of a retained segment from its K/V outputs with the adjoint later segments accumulated (the GRPO
    prompt at group close, earlier OPD turns at trajectory close); no forward, no LM head."""


@dataclass(frozen=True)
class BoundaryPass:
    """One learner pass over ``tokens`` new tokens whose queries attend to ``context_tokens`` cached ones first.

    The attention products therefore have shape ``(tokens × d_head)(d_head × (context_tokens + tokens))``; the context
    K/V are leaves that take a gradient whenever ``context_tokens > 0``. A ``CONTINUATION``'s LM head runs over its
    ``scored_tokens`` rows (``None``: every token).
    """

    work: BoundaryWork
    tokens: int
    context_tokens: int = 0
    scored_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.context_tokens < 0 or not 0 <= (self.scored_tokens or 0) <= self.tokens:
            raise ValueError(
                f"BoundaryPass token counts must be >= 0 (scored_tokens at most tokens); got {self.tokens}, "
                f"{self.context_tokens}, {self.scored_tokens}"
            )

    @property
    def head_tokens(self) -> int:
        """Rows the LM head runs over."""
        return self.tokens if self.scored_tokens is None else self.scored_tokens


def _cached_attention_products(
    shape: DecoderShape, queries: int, keys: int, grad_q: bool, grad_k: bool, grad_v: bool
) -> FlopCount:
    """:func:`_attention_products` for ``queries`` attending to ``keys`` (cached context + themselves)."""
    product = shape.num_heads * matmul_flops(queries, shape.head_dim, keys)
    grad_p = grad_q or grad_k
    return FlopCount(2 * product, product * (int(grad_q) + int(grad_k) + int(grad_p) + int(grad_v)))


def _cached_layer(
    shape: DecoderShape, training: WeightTraining, tokens: int, context: int, grad_in: bool
) -> tuple[FlopCount, bool]:
    """:func:`_layer` for a segment after ``context`` cached tokens, whose K/V (if any) take a gradient."""
    normed = grad_in or training.norms_trained
    count, grads = FlopCount(), {}
    for name in ("q_proj", "k_proj", "v_proj"):
        flops, grads[name] = _projection(shape, training, name, tokens, normed)
        count += flops
    cached = context > 0  # the cached K/V leaves require grad: dK and dV run over every key
    count += _cached_attention_products(
        shape, tokens, context + tokens, grads["q_proj"], grads["k_proj"] or cached, grads["v_proj"] or cached
    )
    flops, grad_attn = _projection(shape, training, "o_proj", tokens, any(grads.values()) or cached)
    count += flops
    residual = grad_in or grad_attn
    normed = residual or training.norms_trained
    gate, grad_gate = _projection(shape, training, "gate_proj", tokens, normed)
    up, grad_up = _projection(shape, training, "up_proj", tokens, normed)
    down, grad_down = _projection(shape, training, "down_proj", tokens, grad_gate or grad_up)
    return count + gate + up + down, residual or grad_down


def boundary_pass_flops(shape: DecoderShape, work: BoundaryPass, training: WeightTraining | None = None) -> FlopCount:
    """Model FLOPs of one pass of the boundary-adjoint context backward, with App. B.1's accounting.

    * ``PREFIX_FORWARD``: the decoder layers' forward over the prompt (the LM head does not run).
    * ``CONTINUATION``: forward and loss backward as :func:`source_flops`, with attention products over
      ``context_tokens + tokens`` keys; with ``context_tokens == 0`` it equals :func:`source_flops`
      ``(tokens, scored_tokens=...)``.
    * ``DEFERRED_BACKWARD``: backward only, from the segment's K/V outputs: every layer but the last in full (its
      output feeds later layers' K/V), and the last layer's K and V projections.
    """
    training = training or WeightTraining.full()
    grad = training.embeddings_trained
    count = FlopCount()
    layers = []
    for _ in range(shape.num_layers):
        layer, next_grad = _cached_layer(shape, training, work.tokens, work.context_tokens, grad)
        layers.append((layer, grad))
        count += layer
        grad = next_grad
    if work.work is BoundaryWork.PREFIX_FORWARD:
        return FlopCount(count.forward, 0)
    if work.work is BoundaryWork.CONTINUATION:
        head, _ = _projection(shape, training, "lm_head", work.head_tokens, grad or training.norms_trained)
        return count + head
    backward = sum(layer.backward for layer, _ in layers[:-1])
    last_grad_in = layers[-1][1] or training.norms_trained
    for name in ("k_proj", "v_proj"):
        backward += _projection(shape, training, name, work.tokens, last_grad_in)[0].backward
    return FlopCount(0, backward)


def boundary_flops(
    shape: DecoderShape, passes: Iterable[BoundaryPass], training: WeightTraining | None = None
) -> FlopCount:
    """Total model FLOPs of a sequence of boundary-adjoint passes (e.g. one GRPO group or one OPD trajectory)."""
    total = FlopCount()
    for work in passes:
        total += boundary_pass_flops(shape, work, training)
    return total
