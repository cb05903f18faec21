"""Per-rank learner memory of a run, planned from the model's config alone (``tslightning plan``).

The model is built from its config in fake tensors (meta-backed: shapes and dtypes, no storage), so a 32B plan runs
on a laptop. What each learner rank's device holds depends on the run's parameter *placement*
(:mod:`tslightning.distributed.parameter_placement`: which of parameters, optimizer state and statistics it shards),
which the plan asks instead of reading strategy names. Per rank:

* **weights** — every parameter in its dtype (a LoRA base in its frozen dtype), divided among the ranks when the
  placement shards parameters; **gathered** — what a pass holds unsharded meanwhile (FSDP2 / ZeRO-3): the root unit's
  parameters and two gradient units (the one running and the one prefetched), in the weights' dtype;
* **gradients** — one *gradient unit* (a decoder block, or one other parameter such as the vocabulary matrix;
  :mod:`tslightning.core.gradient_units`): the learner folds each unit into the statistics as the backward produces
  it, so a source's gradient never exists whole. Sharded statistics add the unit's ring exchange: one row sent and
  one received at a time, 1/world of a unit each (falling with ranks); ``learner.fold_queue_depth`` d adds d
  folds waiting for the folding thread (a unit each, or a row when sharded; on the device when the statistics are,
  else in page-locked host staging buffers);
* **optimizer** — AdamW's two moments per trainable value, in the master weights' dtype (bfloat16 with
  ``optimizer.state_dtype``), divided among the ranks when the placement shards the optimizer state;
* **statistics** — the streaming accumulators (App. D.3): GRPO holds G1 and G2 for each open group plus the batch
  accumulator, (2k + 1) trainable-sized vectors for k open groups; OPD and the ``sync`` schedule one. With sharded
  statistics a rank holds its shard — FSDP2's dim-0 chunk of every trainable parameter, padded — of the groups open on
  *all* ranks: (2k·world + 1) shards with whole groups per rank, (2k + 1) with groups spread over the ranks. On the
  device or the host (``learner.statistics_device``); page-locked host memory is allocated in powers of two (torch's
  caching host allocator rounds every block up), which the host figure includes;
* **activations** — what autograd saves for the backward of one pass over the longest sequence, every token scored,
  counted by tracing the learner's own scoring pass with saved-tensor hooks through the real implementation
  (attention, MLP, and the chunked head, which keeps the scored hidden rows, never T×V logits:
  :mod:`tslightning.objectives.chunked_head`), under autocast for ``bf16-mixed`` (without its weight cache, as the
  learner runs it), without and with activation checkpointing (then the decoder layers' inputs, plus one layer
  recomputed at a time); ``sync`` runs ``micro_batch_size`` sequences a pass (a backlog: at most the longest's tokens);
* **DDP buckets** — replicated parameters on several ranks: DDP's reducer allocates its gradient buckets, a
  trainable-sized buffer, when it wraps the model;
* **barrier** — what the optimizer barrier adds once the passes' memory is free: the reduced direction (on the device
  for the all-reduce), the ``.grad`` the optimizer reads (this rank's shard where parameters are sharded; ZeRO-3's
  surrogate backward gathers the whole model), and publication's one full parameter at a time.

The device's peak is the larger of a pass's total and the barrier's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch

from tslightning.core.gradient_units import gradient_units
from tslightning.objectives.chunked_head import DEFAULT_CHUNK_ROWS
from tslightning.objectives.scored_logprobs import scored_logprobs

_DTYPES = {  # precision → (trainable and master weights, frozen weights, compute)
    "32-true": (torch.float32, torch.float32, torch.float32),
    "64-true": (torch.float64, torch.float64, torch.float64),
    "bf16-mixed": (torch.float32, torch.bfloat16, torch.bfloat16),
    "bf16-true": (torch.bfloat16, torch.bfloat16, torch.bfloat16),
}
GIB = 2**30


@dataclass(frozen=True)
class PlacementTraits:
    """What the plan needs of a parameter placement (any object with these attributes will do, e.g. a
    :class:`~tslightning.distributed.parameter_placement.ParameterPlacement`)."""

    name: str = "replicated"
    shards_parameters: bool = False
    shards_optimizer: bool = False
    shards_statistics: bool = False


@dataclass(frozen=True)
class LearnerShape:
    """What the plan depends on besides the model's config.

    Attributes:
        precision: Fabric's precision name (``32-true``, ``64-true``, ``bf16-mixed``, ``bf16-true``).
        placement: The run's parameter placement (``placement_for(learner.strategy, learner.shard_statistics)``).
        world_size: Learner ranks.
        objective: ``grpo`` or ``opd``.
        schedule: ``thundersync`` (streamed: open groups' statistics) or ``sync`` (one accumulator; the batch's
            learner work runs at the barrier in padded micro-batches).
        open_groups: GRPO groups holding statistics at once on one rank (the admission cap k, else the rank's share);
            with ``spread_groups``, on all ranks together (the cap, which then counts globally, else P).
        sequence_tokens: The longest sequence one pass runs (the context limit).
        statistics_device: ``host`` or ``device``.
        spread_groups: With sharded statistics, each GRPO group's trajectories are dealt over the ranks, so the
            ranks share their open groups (:mod:`tslightning.learner.spread_groups`).
        fold_queue_depth: Gradient units waiting for the background fold (``learner.fold_queue_depth``).
        micro_batch_size: Sequences per padded pass of the ``sync`` schedule.
        logprob_chunk_tokens: Rows of logits the output head holds at a time (``learner.logprob_chunk_tokens``).
        lora_rank: LoRA's r, or ``None`` for full fine-tuning.
        lora_targets: Module names that get adapters.
    """

    precision: str = "32-true"
    placement: Any = field(default_factory=PlacementTraits)
    world_size: int = 1
    objective: str = "grpo"
    schedule: str = "thundersync"
    open_groups: int = 1
    sequence_tokens: int = 2048
    statistics_device: str = "host"
    spread_groups: bool = False
    fold_queue_depth: int = 0
    micro_batch_size: int = 1
    logprob_chunk_tokens: int = DEFAULT_CHUNK_ROWS
    optimizer_state_dtype: str = "float32"
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = ()

    def shards(self, what: str) -> int:
        """Ranks that share ``parameters``, ``optimizer`` or ``statistics`` (1: every rank holds them whole)."""
        return self.world_size if getattr(self.placement, f"shards_{what}") else 1


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
    gathered: int = 0
    """Parameters a pass holds unsharded meanwhile (sharded placements)."""
    ddp_buckets: int = 0
    barrier: int = 0
    """What the barrier adds to weights, optimizer state and device statistics."""
    staging: int = 0
    """Page-locked host staging buffers of the folding thread (host statistics)."""
    host_statistics: int = 0
    """Host memory the statistics take as allocated (page-locked blocks rounded up to powers of two)."""
    largest_unit: int = 0
    """Values of the largest gradient unit."""
    head_transient: int = 0
    """What the chunked output head's backward holds for a moment, at the pass's peak (every activation still
    saved): the head weight in the compute dtype, one chunk's weight gradient, one chunk of logits."""

    def pass_bytes(self, checkpointing: bool) -> int:
        """The device during a pass: everything but host-resident statistics and the barrier's buffers."""
        activations = self.activations_checkpointed + self.layer_recompute if checkpointing else self.activations
        return self._resident + self.gathered + self.gradients + activations + self.head_transient

    def barrier_bytes(self) -> int:
        """The device at the barrier: the passes' memory is free, the direction and ``.grad`` are not."""
        return self._resident + self.barrier

    def device_bytes(self, checkpointing: bool) -> int:
        """What the learner's device holds at its peak: the larger of a pass and the barrier."""
        return max(self.pass_bytes(checkpointing), self.barrier_bytes())

    @property
    def host_bytes(self) -> int:
        """Host memory of the learner beyond the process itself: host statistics and staging buffers."""
        return self.host_statistics + self.staging

    @property
    def _resident(self) -> int:
        return self.weights + self.optimizer + self.ddp_buckets + (self.statistics if self.statistics_on_device else 0)

    def table(self) -> str:
        """A per-rank table in GiB."""
        place = "device" if self.statistics_on_device else f"host ({_readable(self.host_statistics)} allocated)"
        statistics = (
            "statistics (G1/G2 x open groups + batch)"
            if self.statistics_shards == 1
            else f"statistics, 1/{self.statistics_shards} shard "
            + ("(groups open anywhere)" if self.groups_spread else "(all ranks' groups)")
        )
        rows = [
            ("weights", self.weights, "device"),
            ("  gathered during a pass", self.gathered, "device"),
            ("gradients (one unit + ring rows + fold queue)", self.gradients, "device"),
            ("optimizer state (AdamW)", self.optimizer, "device"),
            (statistics, self.statistics, place),
            ("DDP gradient buckets", self.ddp_buckets, "device"),
            ("activations, one pass", self.activations, "device"),
            ("activations, checkpointed (saved)", self.activations_checkpointed, "device"),
            ("  + one layer recomputed", self.layer_recompute, "device"),
            ("  + the head's backward, one chunk", self.head_transient, "device"),
            ("barrier (direction, .grad, publication)", self.barrier, "device"),
            ("fold staging buffers", self.staging, "host (page-locked)"),
            ("device peak", self.device_bytes(False), "without checkpointing"),
            ("device peak", self.device_bytes(True), "with checkpointing"),
        ]
        return "\n".join(f"{name:<46} {_readable(size):>12}  {where}" for name, size, where in rows)

    def advice(self, available: int, shape: LearnerShape, checkpointing: bool = False) -> list[str]:
        """Settings that would bring the device peak under ``available`` bytes, most effective first."""
        if self.device_bytes(checkpointing) <= available:
            return []
        placement = shape.placement
        changes = []
        if not checkpointing:
            changes.append("learner.activation_checkpointing: true")
        if self.statistics_on_device:
            changes.append("learner.statistics_device: host")
        if self.statistics_on_device and placement.shards_parameters and not placement.shards_statistics:
            changes.append("learner.shard_statistics: true (each rank keeps its shard of G1/G2 and the batch)")
        if shape.objective == "grpo" and shape.open_groups > 1 and self.statistics_on_device:
            changes.append("group_admission_cap: 1 (fewer open groups' statistics)")
        if not placement.shards_parameters:
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
    size, statistics_size = _size(trainable_dtype), _size(torch.promote_types(trainable_dtype, torch.float32))
    moments = (
        trainable_dtype if shape.optimizer_state_dtype == "float32" else getattr(torch, shape.optimizer_state_dtype)
    )
    units = _unit_numels(model, shape)
    shards = shape.shards("statistics")
    vectors = 2 * shape.open_groups + 1 if shape.objective == "grpo" and shape.schedule != "sync" else 1
    vector = trainable if shards == 1 else _shard_numel(model, shape, shards)
    if shards > 1 and vectors > 1:  # every rank's open groups (shared ones once, when spread), a padded chunk of each
        vectors = 2 * shape.open_groups * (1 if shape.spread_groups else shards) + 1
    on_device = shape.statistics_device == "device"
    unit = max(units)
    row = max(_unit_numels(model, shape, shards)) if shards > 1 else unit  # a ring step's row: 1/world of a unit
    exchange = 2 * row * statistics_size if shards > 1 else 0  # one row sent, one received
    queued = shape.fold_queue_depth * row * statistics_size  # folds waiting for the folding thread
    passes = shape.micro_batch_size if shape.schedule == "sync" else 1
    trace = (model, shape.sequence_tokens, compute_dtype)
    chunk = shape.logprob_chunk_tokens
    saved = passes * saved_activation_bytes(*trace, chunk_tokens=chunk) if activations else 0
    checkpointed = passes * saved_activation_bytes(*trace, True, chunk_tokens=chunk) if activations else 0
    layers = max(1, getattr(config, "num_hidden_layers", 1))
    weights_shards = shape.shards("parameters")
    return MemoryPlan(
        weights=math.ceil((trainable * size + frozen * _size(frozen_dtype)) / weights_shards),
        gradients=unit * size + exchange + (queued if on_device else 0),
        optimizer=math.ceil(2 * trainable * _size(moments) / shape.shards("optimizer")),
        statistics=vectors * vector * statistics_size,
        activations=saved,
        activations_checkpointed=checkpointed,
        layer_recompute=math.ceil(max(0, saved - checkpointed) / layers),
        statistics_on_device=on_device,
        statistics_shards=shards,
        groups_spread=shards > 1 and shape.spread_groups,
        gathered=_gathered_bytes(model, shape, units, trainable_dtype, frozen_dtype),
        ddp_buckets=trainable * size if shape.world_size > 1 and not shape.placement.shards_optimizer else 0,
        barrier=_barrier_bytes(model, shape, trainable, vector, size, statistics_size),
        staging=0 if on_device else _pinned(row * statistics_size) * shape.fold_queue_depth,
        host_statistics=0 if on_device else vectors * _pinned(vector * statistics_size),
        largest_unit=unit,
        head_transient=_head_transient(
            model, shape, frozen_dtype if shape.lora_rank else trainable_dtype, compute_dtype
        )
        if activations
        else 0,
    )


def _head_transient(model: torch.nn.Module, shape: LearnerShape, weights: torch.dtype, compute: torch.dtype) -> int:
    """The chunked head's backward (:mod:`tslightning.objectives.chunked_head`): the head weight cast to the compute
    dtype (when it differs), one chunk's weight gradient in it, and one chunk of logits with its float32 log-softmax
    and their gradients (16 bytes per row and vocabulary entry)."""
    head = model.get_output_embeddings().weight
    cast = head.numel() * _size(compute) if compute != weights else 0
    gradient = 0 if shape.lora_rank else head.numel() * _size(compute)  # a LoRA base's head is frozen
    return cast + gradient + shape.logprob_chunk_tokens * head.shape[0] * 16


def plan_report(plan: MemoryPlan, shape: LearnerShape, gpu_memory_gb: float | None, checkpointing: bool) -> str:
    """The printed plan: the table, and whether it fits ``gpu_memory_gb`` with the settings to change if not."""
    lines = [
        f"per learner rank: {shape.precision}, {shape.placement.name} placement x {shape.world_size}, "
        f"{shape.objective} {shape.schedule}, {shape.open_groups} open group(s) "
        f"{'over all ranks' if plan.groups_spread else 'per rank'}, {shape.sequence_tokens}-token passes, "
        f"statistics on the {shape.statistics_device}"
        + (f" sharded over {plan.statistics_shards} ranks" if plan.statistics_shards > 1 else "")
        + (f", LoRA r={shape.lora_rank}" if shape.lora_rank else ", full fine-tuning"),
        plan.table(),
        f"largest gradient unit: {plan.largest_unit:,} values; host memory for statistics and staging: "
        f"{plan.host_bytes / GIB:.2f} GiB",
    ]
    if gpu_memory_gb is not None:
        available = int(gpu_memory_gb * GIB)
        need = plan.device_bytes(checkpointing)
        fits = "fits" if need <= available else "does NOT fit"
        lines.append(f"{need / GIB:.2f} GiB with the run's settings {fits} in {gpu_memory_gb:g} GiB of GPU memory")
        if need > available:
            lines += ["change: " + change for change in plan.advice(available, shape, checkpointing)]
    return "\n".join(lines)


def _unit_numels(model: torch.nn.Module, shape: LearnerShape, world_size: int = 1) -> list[int]:
    """Trainable values per gradient unit (:func:`~tslightning.core.gradient_units.gradient_units`); with
    ``world_size`` > 1, one rank's part of each (``ceil(rows / world)`` rows of each tensor, FSDP2's padded chunk)."""
    if not shape.lora_rank:
        parameters = list(model.parameters())
        return [sum(_chunk(parameters[i].shape, world_size) for i in u) for u in gradient_units(model, parameters)]
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    units = [_adapter_numel(block, shape, world_size) for block in model.modules() if type(block).__name__ in blocks]
    return units or [_lora_numel(model, shape)]


def _gathered_bytes(
    model: torch.nn.Module, shape: LearnerShape, units: list[int], trainable: torch.dtype, frozen: torch.dtype
) -> int:
    """Sharded parameters gathered during a pass: the root unit (parameters outside the decoder blocks that are not
    units of their own: the final norm; the embedding too when the head shares it) and the two largest blocks (the
    one running, the one prefetched)."""
    if not shape.placement.shards_parameters or shape.world_size == 1:
        return 0
    dtype = frozen if shape.lora_rank else trainable
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    block_numels = sorted(
        (sum(p.numel() for p in block.parameters()) for block in model.modules() if type(block).__name__ in blocks),
        reverse=True,
    )
    tied = getattr(model.config, "tie_word_embeddings", False)
    head = model.get_output_embeddings().weight.numel()
    root = model.model.norm.weight.numel() + (head if tied else 0)
    running = (block_numels[:2] + [0, 0])[:2]
    return (root + max(sum(running), head + running[0])) * _size(dtype)


def _barrier_bytes(
    model: torch.nn.Module, shape: LearnerShape, trainable: int, vector: int, size: int, statistics_size: int
) -> int:
    """The barrier's own device memory: the reduced direction (all-reduced on the device; a shard's copy when
    sharded), ``.grad`` (this rank's share where the placement shards parameters or optimizer), ZeRO-3's gathered
    model for its surrogate backward, and one full parameter for publication."""
    placement, world, on_device = shape.placement, shape.world_size, shape.statistics_device == "device"
    all_reduced = world > 1 and not placement.shards_statistics  # reduced on the device, whatever holds it
    direction = vector * statistics_size if on_device or all_reduced else 0
    sharded_grad = placement.shards_parameters or placement.shards_optimizer
    grad = math.ceil(trainable * size / world) if sharded_grad else trainable * size
    gathered = trainable * size if placement.shards_parameters and not placement.shards_statistics else 0
    if placement.name != "deepspeed_stage_3":
        gathered = 0
    largest = max(p.numel() for p in model.parameters()) * size
    return direction + grad + gathered + largest


def _pinned(nbytes: int) -> int:
    """The page-locked block torch's caching host allocator reserves for ``nbytes``: the next power of two."""
    return 0 if nbytes <= 0 else 2 ** math.ceil(math.log2(nbytes))


def saved_activation_bytes(
    model: torch.nn.Module,
    tokens: int,
    compute_dtype: torch.dtype | None = None,
    checkpointing: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_ROWS,
) -> int:
    """Bytes autograd saves for the backward of one scoring pass over ``tokens`` tokens (one sequence, every token
    after the first scored), through the learner's own :func:`~tslightning.objectives.scored_logprobs.scored_logprobs`
    and its chunked head (the scored hidden rows, never T×V logits; the backward recomputes ``chunk_tokens`` rows of
    logits at a time, transiently), and the log-probs it returns; parameters (saved by reference) are not counted,
    and a tensor saved twice counts once.

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
        torch.autocast("cpu", dtype=compute_dtype, cache_enabled=False)  # as the learner's passes run it
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
    if shape.lora_rank:
        return _adapter_numel(model, shape, world_size)
    return sum(_chunk(p.shape, world_size) for p in model.parameters())


def _adapter_numel(module: torch.nn.Module, shape: LearnerShape, world_size: int) -> int:
    """One rank's chunks of the LoRA factors A (r × in) and B (out × r) of the targeted linears in ``module``."""
    r = shape.lora_rank
    return sum(
        _chunk((r, linear.in_features), world_size) + _chunk((linear.out_features, r), world_size)
        for name, linear in module.named_modules()
        if isinstance(linear, torch.nn.Linear) and name.rsplit(".", 1)[-1] in shape.lora_targets
    )


def _chunk(shape: Sequence[int], world_size: int) -> int:
    """Values in one rank's FSDP2 chunk of a tensor of ``shape``: ``ceil(rows / world)`` rows (a scalar: 1)."""
    rows = shape[0] if len(shape) > 0 else 1
    return math.ceil(rows / world_size) * math.prod(shape[1:])


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
