"""θ_{k+1} as a publication sends it: one full tensor at a time, in the served dtype, after the step's kernels.

:func:`full_tensors` turns the learner's parameters into full tensors one at a time, each asked of the run's
:class:`~tslightning.distributed.parameter_placement.ParameterPlacement` (``full_tensor``): a replicated policy's own
tensors, an FSDP2 shard's ``full_tensor()`` or a ZeRO-3 parameter gathered on its own (collectives every rank enters,
in the same order). :class:`PublishedWeights` wraps it into the :class:`~tslightning.rollout.engine.WeightStream`
engines consume: each tensor cast to the engine's serving dtype as it is produced (a bf16 server never receives, and
the learner never stages, an fp32 copy of the model) and a peft policy's LoRA adapters merged layer by layer from
full factors (no merged copy of the model either, sharded or not).

Ordering. The optimizer step's kernels are queued on the learner's stream; a transfer may read the parameters on
another stream (vLLM's NCCL sender packs and broadcasts on side streams of its own), which nothing orders after the
step. :func:`step_completion` records an event on the learner's stream when publication starts, right after the
step, and every pass of the stream waits for it before producing its first tensor.

Sharded learners produce each tensor collectively. When one rank publishes for all (shared servers, or one engine),
the others :meth:`PublishedWeights.follow` it: the publishing rank announces each pass it starts over the control
group, and the others join that pass's gathers, until it announces the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from tslightning.distributed.collectives import control_broadcast
from tslightning.distributed.parameter_placement import ParameterPlacement
from tslightning.rollout.engine import TensorMeta, WeightStream

REPLICATED = ParameterPlacement()

_PASS, _DONE = "pass", "done"


def full_tensors(
    policy: torch.nn.Module, placement: ParameterPlacement = REPLICATED
) -> Iterator[tuple[str, torch.Tensor]]:
    """``policy.state_dict()``'s entries with full values, one at a time, in state-dict order; a sharded parameter is
    gathered when its turn comes (``placement.full_tensor``, a collective every rank runs in the same order)."""
    for name, tensor in policy.state_dict(keep_vars=True).items():
        yield name, placement.full_tensor(tensor)


def tensor_metadata(
    policy: torch.nn.Module, dtype: torch.dtype | None, placement: ParameterPlacement = REPLICATED
) -> list[TensorMeta]:
    """What :func:`full_tensors` (cast to ``dtype``; ``None``: as held) will yield, without gathering anything."""
    return [
        TensorMeta(name, _served(tensor.dtype, dtype), placement.full_shape(tensor))
        for name, tensor in policy.state_dict(keep_vars=True).items()
    ]


def merged_lora_tensors(policy: Any, placement: ParameterPlacement = REPLICATED) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft policy's full weights under the base model's names, each LoRA layer's weight merged on its own
    (W + Σ_adapters scaling·B·A, as ``merge_and_unload`` computes it), adapters left out; the policy is untouched.
    Every factor is a full tensor of ``placement`` (gathered one at a time where parameters are sharded)."""
    from peft.tuners.lora import LoraLayer

    model = policy.get_base_model()
    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if ".lora_" in name:
            continue
        layer_name, base, parameter = name.rpartition(".base_layer.")
        value = placement.full_tensor(tensor)
        if base and parameter == "weight":
            layer = layers[layer_name]
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    value = value + _delta_weight(layer, adapter, placement).to(value.dtype)
        yield (f"{layer_name}.{parameter}" if base else name), value


def _delta_weight(layer: Any, adapter: str, placement: ParameterPlacement) -> torch.Tensor:
    """ΔW of one adapter of one LoRA layer: peft's own where the factors are whole, else its ``Linear`` formula
    (scaling · B·A, transposed for ``fan_in_fan_out``) on gathered factors."""
    if not placement.shards_parameters:
        return layer.get_delta_weight(adapter)
    if type(layer).__name__ != "Linear" or layer.use_dora.get(adapter, False):
        raise ValueError(
            f"publishing a sharded LoRA policy merges plain Linear adapters; {type(layer).__name__} (DoRA: "
            f"{layer.use_dora.get(adapter, False)}) is not one: target Linear modules without DoRA (model.lora)"
        )
    a = placement.full_tensor(layer.lora_A[adapter].weight)
    b = placement.full_tensor(layer.lora_B[adapter].weight)
    delta = b @ a
    return (delta.T if layer.fan_in_fan_out else delta) * layer.scaling[adapter]


def merged_lora_metadata(
    policy: Any, dtype: torch.dtype | None, placement: ParameterPlacement = REPLICATED
) -> list[TensorMeta]:
    """What :func:`merged_lora_tensors` (cast to ``dtype``) will yield."""
    metadata = []
    for name, tensor in policy.get_base_model().state_dict(keep_vars=True).items():
        if ".lora_" not in name:
            shape = placement.full_shape(tensor)
            metadata.append(TensorMeta(name.replace(".base_layer.", "."), _served(tensor.dtype, dtype), shape))
    return metadata


def step_completion(device: torch.device) -> Callable[[], None]:
    """Mark the end of the kernels queued so far on ``device``'s current stream (the optimizer step's); returns the
    wait for them. A no-op on a CPU."""
    if device.type != "cuda":
        return _nothing
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event.synchronize


class PublishedWeights(WeightStream):
    """θ_{k+1} for one publication: a :class:`WeightStream` over :func:`full_tensors` (or, for a peft policy,
    :func:`merged_lora_tensors`) cast to ``dtype``, each pass ordered after ``ready``.

    Args:
        policy: The model the replicas serve.
        placement: Where its parameters live (the run's; it gathers each full tensor).
        dtype: The engine's serving dtype (floating tensors are cast to it); ``None``: as the learner holds them.
        ready: Waits for the optimizer step's kernels (:func:`step_completion`).
        leads: This rank publishes for ranks that :meth:`follow` it (a sharded policy's gathers need them all).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        placement: ParameterPlacement,
        dtype: torch.dtype | None = None,
        ready: Callable[[], None] = lambda: None,
        leads: bool = False,
    ) -> None:
        merged = _is_peft(policy)
        metadata = (merged_lora_metadata if merged else tensor_metadata)(policy, dtype, placement)
        super().__init__(metadata, self._produce)
        self.policy, self.placement, self.dtype, self.ready, self.merged = policy, placement, dtype, ready, merged
        self.collective = placement.shards_parameters
        self.leads = leads and self.collective
        self.passes = 0

    def _produce(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.leads:
            control_broadcast(_PASS, src=0)  # the followers join this pass's gathers
        self.ready()  # before the first read of θ_{k+1}: the step's kernels have finished
        self.passes += 1
        tensors = self._full_tensors()
        with _completed(tensors) if self.collective else nullcontext():
            for name, tensor in tensors:
                yield name, tensor.to(_served(tensor.dtype, self.dtype))

    def finish(self) -> None:
        """The publishing rank, after its engine returned (or failed): the followers stop following."""
        if self.leads:
            control_broadcast(_DONE, src=0)

    def follow(self) -> int:
        """A rank that does not publish: join every pass the publishing rank announces (each gather of a sharded
        policy), dropping the tensors, until it announces the end; returns the passes joined. Nothing to do for a
        replicated policy."""
        if not self.collective:
            return 0
        joined = 0
        while control_broadcast(None, src=0) == _PASS:
            for _ in self._full_tensors():  # the same gathers, in the same order, as the publishing rank's
                pass
            joined += 1
        return joined

    def _full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return (merged_lora_tensors if self.merged else full_tensors)(self.policy, self.placement)


@contextmanager
def _completed(tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[None]:
    """Finish ``tensors`` even when the consumer stops early (a failed send): the other ranks' gathers of a sharded
    policy need this rank's part of every remaining one."""
    try:
        yield
    finally:
        for _ in tensors:
            pass


def _is_peft(policy: torch.nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(policy, PeftModel)


def _served(held: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and held.is_floating_point else held


def _nothing() -> None:
    return None
