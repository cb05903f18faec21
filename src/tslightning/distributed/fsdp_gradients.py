"""FSDP2 learner ranks (``torch.distributed.fsdp.fully_shard``): per-source gradients through the unsharded
parameters, and the batch direction handed to the shards (Eq. 3).

Fabric runs FSDP2 through its ``ModelParallelStrategy`` (on CPU over gloo too) with :func:`shard_policy` as the
``parallelize_fn``: every decoder block of the policy and the policy itself become FSDP units, so a forward
all-gathers one block's parameters at a time and frees them after it (``reshard_after_forward``). Outside a forward
each parameter is a ``DTensor`` shard.

* **Per-source gradient.** A pass's autograd leaves are the units' *unsharded* parameters, not the DTensor shards,
  so the learner differentiates with respect to those (:func:`gradient_leaves`). ``torch.autograd.grad`` leaves
  their ``.grad`` empty, so FSDP's post-backward reduce-scatter has nothing to send; the placement folds each unit's
  gradient as the backward produces it (:mod:`tslightning.distributed.parameter_placement`) — into this rank's
  statistics, or shard by shard into every rank's under sharded statistics.
* **Lock-step.** Every forward and backward all-gathers block by block, collectives all ranks must enter together,
  so several ranks serve their sources in lock-step ticks (:mod:`tslightning.distributed.lockstep`).
* **Units.** One per decoder block; untied input embedding and output head one each (gathered only while used:
  FSDP2 keeps the root unit's parameters unsharded for the whole pass); a peft policy's LoRA adapter layers one each
  (FSDP2 gathers a unit in one dtype, and the float32 adapters sit beside a bfloat16 base); the root takes the rest.
* **Barrier.** Every rank holds the whole reduced direction; its own shard of it becomes each DTensor's ``.grad``
  (no communication) and the optimizer steps the shards.
"""

from __future__ import annotations

import lightning as L
import torch

from tslightning.core.parameter_layout import ParameterLayout


def shards_parameters(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are FSDP2 DTensor shards."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def shard_policy(module: L.LightningModule, device_mesh) -> L.LightningModule:
    """``ModelParallelStrategy``'s ``parallelize_fn``: FSDP2 over the data-parallel ranks, one unit per decoder block.

    ``module`` is a :class:`~tslightning.learner.streaming_module.StreamingPolicyModule`; its :attr:`layout` is re-bound
    to the sharded parameters (``fully_shard`` replaces every parameter object), so build the optimizer after this.

    Raises:
        ValueError: with tensor parallelism (a mesh whose ``tensor_parallel`` size is not 1).
    """
    from torch.distributed.fsdp import fully_shard

    if device_mesh["tensor_parallel"].size() != 1:
        raise ValueError(
            f"learner ranks shard parameters with FSDP over data-parallel ranks only; got a tensor-parallel size of "
            f"{device_mesh['tensor_parallel'].size()} (set ModelParallelStrategy(tensor_parallel_size=1))"
        )
    mesh = device_mesh["data_parallel"]
    policy = module.policy
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy  # peft: the wrapped model
    blocks = set(getattr(base, "_no_split_modules", None) or [])
    if not blocks:
        raise ValueError(
            f"{type(base).__name__} names no decoder blocks (_no_split_modules); FSDP needs them as its units"
        )
    for adapter in _adapter_layers(policy):  # trainable float32 adapters beside a frozen bf16 base: units of their own
        fully_shard(adapter, mesh=mesh)
    for submodule in list(policy.modules()):
        if type(submodule).__name__ in blocks:
            fully_shard(submodule, mesh=mesh)
    for outer in _untied_vocabulary_matrices(base):  # gathered only while used, not for the whole pass as the root's
        fully_shard(outer, mesh=mesh)
    fully_shard(
        policy, mesh=mesh
    )  # the root unit: what is left (the final norm; the embedding when the head shares it)
    module.layout.rebind(policy.parameters())
    return module


def _adapter_layers(policy: torch.nn.Module) -> list[torch.nn.Module]:
    """A peft policy's LoRA adapter layers (each ``lora_A``/``lora_B`` linear): FSDP2 all-gathers a unit's parameters
    in one buffer of one dtype, so adapters trained in float32 cannot share a unit with their bfloat16 base."""
    layers = []
    for module in policy.modules():
        for name in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
            container = getattr(module, name, None)
            if isinstance(container, torch.nn.ModuleDict):
                layers += [layer for layer in container.values() if any(True for _ in layer.parameters())]
    return layers


def _untied_vocabulary_matrices(base: torch.nn.Module) -> list[torch.nn.Module]:
    """The input embedding and the output head when they do not share their weight (a shared one stays in the root)."""
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    if head is None or embedding is None or head.weight is embedding.weight:
        return []
    return [embedding, head]


def gradient_leaves(policy: torch.nn.Module, parameters: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The tensors a pass of ``policy`` differentiates for ``parameters``: under FSDP2 each shard's unsharded
    parameter (call after the pass's forward, which creates them on first use); other parameters as they are."""
    from torch.distributed.fsdp import FSDPModule

    unsharded = {}
    for submodule in policy.modules():
        if isinstance(submodule, FSDPModule):
            group = submodule._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else []:
                unsharded[id(fsdp_param.sharded_param)] = fsdp_param
    return [unsharded[id(p)].unsharded_param if id(p) in unsharded else p for p in parameters]


def write_direction(layout: ParameterLayout, direction: torch.Tensor, scale: float) -> None:
    """Set each DTensor parameter's ``.grad`` to its own shard of ``scale · direction`` (no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, d in zip(layout.parameters, layout.unflatten(direction), strict=True):
        full = (d * scale).to(device=p.device, dtype=p.dtype)
        if isinstance(p, DTensor):
            p.grad = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        else:
            p.grad = full


def full_state_dict(policy: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """``policy.state_dict()`` with every DTensor shard all-gathered (a collective every rank must enter), one
    parameter at a time; ``keep=False`` (a rank that does not publish) joins each gather, drops its result and returns
    ``{}``, so no full copy is staged there."""
    from torch.distributed.tensor import DTensor

    state: dict[str, torch.Tensor] = {}
    for name, tensor in policy.state_dict().items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if keep:
            state[name] = full
    return state
