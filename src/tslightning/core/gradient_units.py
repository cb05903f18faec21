"""Gradient units: the grain at which a source's gradient is folded into the statistics while the backward runs.

The streaming learner never holds a source's whole gradient: each *unit*'s gradient is folded (and, with sharded
statistics, exchanged) as soon as the backward pass has produced it, then freed
(:class:`~tslightning.core.unit_backward.UnitBackward`). A unit is one decoder block (the model's
``_no_split_modules``, FSDP2's units too, :func:`~tslightning.distributed.fsdp_gradients.shard_policy`); every other
trainable parameter — embeddings, the final norm, the output head — is a unit of its own, so the largest unit is one
block or the vocabulary matrix, never the model.

Units are numbered by their first parameter in :class:`~tslightning.core.parameter_layout.ParameterLayout` order. A
causal LM's backward produces them last to first (head, final norm, last block, ..., first block, embedding): the
fixed *fold order* every rank folds and exchanges them in (:func:`fold_order`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def gradient_units(policy: torch.nn.Module, parameters: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices into ``parameters`` grouped into units: one per decoder block, one per remaining parameter.

    Args:
        policy: The causal LM (a peft wrapper is looked through for the block types).
        parameters: The trainable parameters in layout order (the policy's own objects, before any sharding).

    Returns:
        Units in order of their first index; every index appears in exactly one unit.
    """
    index = {id(p): i for i, p in enumerate(parameters)}
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    blocks = set(getattr(base, "_no_split_modules", None) or [])
    units: list[list[int]] = []
    assigned: set[int] = set()
    for module in policy.modules():
        if type(module).__name__ not in blocks:
            continue
        members = sorted(index[id(p)] for p in module.parameters() if id(p) in index and index[id(p)] not in assigned)
        if members:
            units.append(members)
            assigned.update(members)
    units.extend([i] for i in range(len(parameters)) if i not in assigned)
    return sorted(units, key=lambda unit: unit[0])


def fold_order(units: Sequence[Sequence[int]]) -> list[int]:
    """Unit indices in the order a backward produces them (last unit first): the order every rank folds them in."""
    return list(range(len(units) - 1, -1, -1))


def unit_numel(units: Sequence[Sequence[int]], shapes: Sequence[torch.Size]) -> list[int]:
    """Values in each unit (the sum of its parameters' full sizes)."""
    return [sum(shapes[i].numel() for i in unit) for unit in units]
