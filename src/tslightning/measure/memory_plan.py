"""Per-rank learner memory of a run, planned from the model's config alone (``tslightning plan``).

The model is built from its config in fake tensors (meta-backed: shapes and dtypes, no storage), so a 32B plan runs
on a laptop. Per learner rank:

* **weights** — every parameter in its dtype (a LoRA base in its frozen dtype), divided among the ranks by the
  strategies that shard parameters (``fsdp``, ``deepspeed_stage_3``);
* **gradients** — one source's gradient, the size of the trainable parameters: the streaming learner takes each
  source's gradient whole (``torch.autograd.grad``) before folding it into the statistics, and the barrier writes
  the direction into ``.grad`` (partitioned under ZeRO and FSDP, which the per-source gradient is not); with
  ``learner.fold_queue_depth`` d, d more, waiting for the background fold;
* **optimizer** — AdamW's two moments per trainable value, in the master weights' dtype, divided among the ranks by
  ``fsdp`` and ZeRO-2/3;
* **statistics** — the streaming accumulators (App. D.3): GRPO holds G1 and G2 for each open group plus the batch
  accumulator, (2k + 1) trainable-sized vectors for k open groups; OPD one. Where they live (host or device) is
  ``learner.statistics_device``. With ``learner.shard_statistics`` (``fsdp``, GRPO) a rank holds its shard — FSDP2's
  dim-0 chunk of every trainable parameter, padded — of G1/G2 of the groups open on *all* ranks and of the batch
  accumulator: (2k·world + 1) shards with whole groups per rank (k per rank), (2k + 1) shards with groups spread
  over the ranks by trajectory (``fit`` spreads them under ``shard_statistics``; k counts groups open anywhere);
* **activations** — what autograd saves for the backward of one pass over the longest sequence, every token scored,
  counted by tracing the learner's real scoring pass (:func:`~tslightning.objectives.scored_logprobs.scored_logprobs`)
  with saved-tensor hooks (the implementation's real attention and MLP, not a formula), without and with activation
  checkpointing (then the decoder layers' inputs, plus one layer recomputed at a time). The output head keeps the
  scored hidden rows, never T×V logits (:mod:`tslightning.objectives.chunked_head`); its backward recomputes one
  chunk of ``logprob_chunk_tokens`` rows of logits at a time, transiently, as a checkpointed layer is.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from tslightning.objectives.chunked_head import DEFAULT_CHUNK_ROWS
from tslightning.objectives.scored_logprobs import scored_logprobs

_SHARDS_WEIGHTS = ("fsdp", "deepspeed_stage_3")
_SHARDS_OPTIMIZER = ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3")
_DTYPES = {  # precision → (trainable and master weights, frozen weights, compute)
    "32-true": (torch.float32, torch.float32, torch.float32),
    "64-true": (torch.float64, torch.float64, torch.float64),
    "bf16-mixed": (torch.float32, torch.bfloat16, torch.bfloat16),
    "bf16-true": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
}
GIB = 2**30


@dataclass(frozen=True)
class LearnerShape:
    """What the plan depends on besides the model's config.

    Attributes:
        precision: Fabric's precision name (``32-true``, ``64-true``, ``bf16-mixed``, ``bf16-true``).
        strategy: The learner strategy (``ddp``, ``fsdp``, ``deepspeed_stage_2``, ``deepspeed_stage_3``, ``auto``).
        world_size: Learner ranks.
        objective: ``grpo`` or ``opd``.
        open_groups: GRPO groups holding statistics at once on one rank (the admission cap k, else the rank's share);
            with ``spread_groups``, on all ranks together (the cap, which then counts globally, else P).
        sequence_tokens: The longest sequence one pass runs (the context limit).
        statistics_device: ``host`` or ``device``.
        shard_statistics: Each rank keeps only its shard of the statistics (``fsdp`` and GRPO).
        spread_groups: With ``shard_statistics``, each GRPO group's trajectories are dealt over the ranks, so the
            ranks share their open groups (:mod:`tslightning.learner.spread_groups`).
        fold_queue_depth: Source gradients waiting for the background fold (``learner.fold_queue_depth``).
        logprob_chunk_tokens: Rows of logits the output head holds at a time (``learner.logprob_chunk_tokens``).
        lora_rank: LoRA's r, or ``None`` for full fine-tuning.
        lora_targets: Module names that get adapters.
    """

    precision: str = "32-true"
    strategy: str = "auto"
    world_size: int = 1
    objective: str = "grpo"
    open_groups: int = 1
    sequence_tokens: int = 2048
    statistics_device: str = "host"
    shard_statistics: bool = False
    spread_groups: bool = False
    fold_queue_depth: int = 0
    logprob_chunk_tokens: int = DEFAULT_CHUNK_ROWS
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ()


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per learner rank, by component (see the module docstring)."""

    weights: int
    gradients: int
    optimizer: int
    statistics: int
    activations: int
    activations_checkpointed: int
    """Saved with activation checkpointing: the checkpointed layers' inputs and what runs outside them."""
    layer_recompute: int
    """One decoder layer's activations, re-materialized at a time in a checkpointed backward."""
    statistics_on_device: bool
    statistics_shards: int = 1
    """Ranks the statistics are sharded over (1: every rank holds them whole)."""
    groups_spread: bool = False
    """Sharded, with GRPO groups spread over the ranks: the shards hold the groups open anywhere, not k per rank."""

    def device_bytes(self, checkpointing: bool) -> int:
        """What the learner's device holds at its peak: everything but host-resident statistics."""
        activations = self.activations_checkpointed + self.layer_recompute if checkpointing else self.activations
        statistics = self.statistics if self.statistics_on_device else 0
        return self.weights + self.gradients + self.optimizer + statistics + activations

    def table(self) -> str:
        """A per-rank table in GiB."""
        place = "device" if self.statistics_on_device else "host"
        statistics = (
            "statistics (G1/G2 x open groups + batch)"
            if self.statistics_shards == 1
            else f"statistics, 1/{self.statistics_shards} shard "
            + ("(groups open anywhere)" if self.groups_spread else "(all ranks' groups)")
        )
        rows = [
            ("weights", self.weights, "device"),
            ("gradients (one source + fold queue)", self.gradients, "device"),
            ("optimizer state (AdamW)", self.optimizer, "device"),
            (statistics, self.statistics, place),
            ("activations, one pass", self.activations, "device"),
            ("activations, checkpointed (saved)", self.activations_checkpointed, "device"),
            ("  + one layer recomputed", self.layer_recompute, "device"),
            ("device total", self.device_bytes(False), "without checkpointing"),
            ("device total", self.device_bytes(True), "with checkpointing"),
        ]
        return "\n".join(f"{name:<42} {_readable(size):>12}  {where}" for name, size, where in rows)

    def advice(self, available: int, shape: LearnerShape, checkpointing: bool = False) -> list[str]:
        """Settings that would bring the device total under ``available`` bytes, most effective first."""
        if self.device_bytes(checkpointing) <= available:
            return []
        changes = []
        if not checkpointing:
            changes.append("learner.activation_checkpointing: true")
        if self.statistics_on_device:
            changes.append("learner.statistics_device: host")
        if (
            self.statistics_on_device
            and shape.strategy == "fsdp"
            and shape.objective == "grpo"
            and self.statistics_shards == 1
        ):
            changes.append("learner.shard_statistics: true (each rank keeps its shard of G1/G2 and the batch)")
        if shape.objective == "grpo" and shape.open_groups > 1 and self.statistics_on_device:
            changes.append("group_admission_cap: 1 (fewer open groups' statistics)")
        if shape.strategy not in _SHARDS_WEIGHTS:
            changes.append("learner.strategy: fsdp (shard weights and optimizer state over more learner ranks)")
        else:
            changes.append("learner.devices / learner.num_nodes: more ranks to shard over")
        if shape.lora_rank is None:
            changes.append("model.lora: {r: 32, alpha: 64} (train adapters only)")
        changes.append("rollout.max_context_tokens: lower (shorter passes)")
        return changes


def plan_learner_memory(config: Any, shape: LearnerShape, activations: bool = True) -> MemoryPlan:
    """The plan for a Hugging Face causal LM with ``config`` (a ``PretrainedConfig``) trained as ``shape`` says;
    ``activations=False`` skips the activation traces (their fields are 0)."""
    trainable_dtype, frozen_dtype, compute_dtype = _DTYPES[shape.precision]
    model = _fake_model(config, frozen_dtype if shape.lora_rank else trainable_dtype)
    total = sum(p.numel() for p in model.parameters())
    trainable = _lora_numel(model, shape) if shape.lora_rank else total
    frozen = total if shape.lora_rank else 0
    weights = trainable * _size(trainable_dtype) + frozen * _size(frozen_dtype)
    statistics_dtype = torch.promote_types(trainable_dtype, torch.float32)
    vectors = 2 * shape.open_groups + 1 if shape.objective == "grpo" else 1
    statistics = vectors * trainable
    shards = shape.world_size if shape.shard_statistics and shape.strategy == "fsdp" else 1
    if shards > 1:  # every rank's open groups (shared ones once, when spread), a padded dim-0 chunk of each
        open_anywhere = shape.open_groups * (1 if shape.spread_groups else shards)
        statistics = (2 * open_anywhere + 1) * _shard_numel(model, shape, shards)
    sharded = shape.world_size if shape.strategy in _SHARDS_WEIGHTS else 1
    optimizer_shards = shape.world_size if shape.strategy in _SHARDS_OPTIMIZER else 1
    trace = (model, shape.sequence_tokens, compute_dtype)
    chunk = shape.logprob_chunk_tokens
    activations = saved_activation_bytes(*trace, chunk_tokens=chunk) if activations else 0
    checkpointed = saved_activation_bytes(*trace, True, chunk_tokens=chunk) if activations else 0
    layers = max(1, getattr(config, "num_hidden_layers", 1))
    return MemoryPlan(
        weights=math.ceil(weights / sharded),
        gradients=(1 + shape.fold_queue_depth) * trainable * _size(trainable_dtype),
        optimizer=math.ceil(2 * trainable * _size(trainable_dtype) / optimizer_shards),
        statistics=statistics * _size(statistics_dtype),
        activations=activations,
        activations_checkpointed=checkpointed,
        layer_recompute=math.ceil(max(0, activations - checkpointed) / layers),
        statistics_on_device=shape.statistics_device == "device",
        statistics_shards=shards,
        groups_spread=shards > 1 and shape.spread_groups,
    )


def saved_activation_bytes(
    model: torch.nn.Module,
    tokens: int,
    compute_dtype: torch.dtype | None = None,
    checkpointing: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_ROWS,
) -> int:
    """Bytes autograd saves for the backward of one scoring pass over ``tokens`` tokens (one sequence, every token
    after the first scored), through the learner's own :func:`~tslightning.objectives.scored_logprobs.scored_logprobs`
    and its chunked head, and the log-probs it returns; parameters (saved by reference) are not counted, and a tensor
    saved twice counts once.

    ``model`` may hold real or fake tensors; ``compute_dtype`` below the weights' dtype traces under autocast, as
    ``bf16-mixed`` runs. ``checkpointing`` turns on the model's activation checkpointing for the trace.
    """
    parameters = {id(p) for p in model.parameters()}
    counted: set[tuple[int, int, int]] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if id(tensor) in parameters or (tensor._base is not None and id(tensor._base) in parameters):
            return tensor
        key = (tensor.untyped_storage()._cdata, tensor.storage_offset(), tensor.numel())
        if key not in counted:
            counted.add(key)
            total += tensor.numel() * tensor.element_size()
        return tensor

    weights_dtype = next(model.parameters()).dtype
    autocast = (
        torch.autocast("cpu", dtype=compute_dtype)
        if compute_dtype is not None and compute_dtype.itemsize < weights_dtype.itemsize
        else nullcontext()
    )
    ids = torch.zeros(tokens, dtype=torch.long)
    scored = torch.arange(tokens) > 0
    with _checkpointing(model, checkpointing, held=pack), _one_unpacked_sequence(), autocast:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            pack(scored_logprobs(model, ids, scored, chunk_tokens))  # the log-probs live until the backward too
    return total


def _fake_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=getattr(config, "_attn_implementation", None) or "sdpa"
        )


def _lora_numel(model: torch.nn.Module, shape: LearnerShape) -> int:
    """Adapter values: r·(in + out) for every linear layer whose name ends in a target."""
    return sum(
        shape.lora_rank * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in shape.lora_targets
    )


def _shard_numel(model: torch.nn.Module, shape: LearnerShape, world_size: int) -> int:
    """Values in one rank's shard of a statistic: ceil(rows / world) rows of every trainable tensor (FSDP2's chunk,
    padded), LoRA's A (r × in) and B (out × r) included."""

    def chunk(rows: int, row: int) -> int:
        return math.ceil(rows / world_size) * row

    if shape.lora_rank:
        return sum(
            chunk(shape.lora_rank, module.in_features) + chunk(module.out_features, shape.lora_rank)
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in shape.lora_targets
        )
    return sum(chunk(p.shape[0], math.prod(p.shape[1:])) if p.dim() else 1 for p in model.parameters())


def _readable(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB else f"{size / 2**20:.1f} MiB"


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@contextmanager
def _checkpointing(model: torch.nn.Module, enabled: bool, held: Any) -> Iterator[None]:
    """Turn on the model's activation checkpointing; ``held`` sees every tensor a checkpointed layer keeps for its
    recomputation (its inputs, keyword ones included), which autograd's saved-tensor hooks do not."""
    if not enabled:
        yield
        return
    training = model.training
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # transformers checkpoints in training mode only
    for layer in model.modules():
        if getattr(layer, "gradient_checkpointing", False) and hasattr(layer, "_gradient_checkpointing_func"):
            layer._gradient_checkpointing_func = _holding(layer._gradient_checkpointing_func, held)
    try:
        yield
    finally:
        model.gradient_checkpointing_disable()
        model.train(training)


def _holding(checkpoint: Any, held: Any) -> Any:
    def checkpointed(function: Any, *args: Any) -> Any:
        for value in [*args, *getattr(function, "keywords", {}).values()]:
            for tensor in value if isinstance(value, tuple | list) else (value,):
                if isinstance(tensor, torch.Tensor):
                    held(tensor)
        return checkpoint(function, *args)

    return checkpointed


@contextmanager
def _one_unpacked_sequence() -> Iterator[None]:
    """transformers inspects position ids for packed sequences with a data-dependent check that fake tensors cannot
    answer; a traced pass is one sequence, never packed."""
    with mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None):
        yield
