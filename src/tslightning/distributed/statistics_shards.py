"""GRPO statistics sharded like FSDP2's parameters (``learner.shard_statistics``): each rank holds only its shard.

Unsharded, every rank keeps G1' and G2 of each of its open groups and the batch accumulator whole:
``(2·open + 1) · numel`` values per rank, ~84 GB at 7B. Sharded, rank j keeps shard j (FSDP2's dim-0 chunks, padded;
:class:`~tslightning.core.shard_layout.ShardLayout`) of the statistics of *every* open group, whichever rank serves
it: ``(2·open + 1) · numel / world`` (+ padding), ``open`` counted over all ranks.

Folding, one lock-step tick at a time (:mod:`tslightning.distributed.lockstep`): the pass of each rank leaves at most
one contribution staged (a trajectory's H_i with its group, group size and reward; or a ``sync`` micro-batch's
gradient, which goes straight into the batch accumulator). Then every rank enters :meth:`StatisticsShards.exchange`:

1. the contributions' descriptions are all-gathered (a control message), so every rank knows each source's group and
   reward;
2. one ``all_to_all_single`` sends shard j of each staged gradient to rank j (an idle rank sends nothing);
3. every rank folds the shards it received, in rank order, into its shard of the right group's G1'/G2 (Eq. 7) —
   the same operations on the same values the unsharded accumulator runs, so the update is as exact — and closes a
   group on its own once all m of its sources are folded (all m rewards travelled with them: μ and a_G are known
   everywhere).

At the barrier the rank's batch-accumulator shard *is* its part of g_k: its norm is one all-reduce of a float64
scalar, and each DTensor parameter's ``.grad`` is the matching view of the shard (no all-reduce of the direction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tslightning.core.group_accumulator import GroupAccumulator, GroupReduction
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.shard_layout import ShardLayout
from tslightning.distributed.collectives import (
    all_to_all_rows,
    control_all_gather,
    control_all_reduce,
    control_group,
    distributed,
)
from tslightning.objectives.advantages import AdvantageEstimator


def statistics_shards(
    shard: bool,
    layout: ParameterLayout,
    estimator: AdvantageEstimator,
    eps: float,
    dtype: torch.dtype,
    objective: str,
    context_backward: str,
    fold_queue_depth: int,
) -> StatisticsShards | None:
    """The streaming module's :class:`StatisticsShards` when ``shard`` (``None`` otherwise).

    Raises:
        ValueError: for what cannot be sharded: an ``objective`` other than ``grpo``, a ``context_backward`` other
            than ``recompute`` (lock-step), or background folding (``fold_queue_depth``; shards fold at the exchange).
    """
    if not shard:
        return None
    if objective != "grpo" or context_backward != "recompute" or fold_queue_depth:
        raise ValueError(
            "shard_statistics shards GRPO statistics under context_backward='recompute' and folds them at each tick's "
            f"exchange; got objective {objective!r}, context_backward {context_backward!r}, fold_queue_depth "
            f"{fold_queue_depth} (set shard_statistics false)"
        )
    return StatisticsShards(layout, estimator, eps, dtype)


@dataclass(frozen=True)
class Contribution:
    """What travels with one staged gradient: its group, the group's size and the source's reward; ``group_id``
    ``None`` for a gradient that goes straight into the batch accumulator (a ``sync`` micro-batch)."""

    group_id: str | None
    group_size: int = 0
    reward: float = 0.0


class StatisticsShards:
    """This rank's shard of the GRPO statistics of every open group and of the batch accumulator.

    Args:
        layout: The trainable parameters (full shapes).
        estimator, eps, dtype: As for :class:`~tslightning.core.group_accumulator.GroupAccumulator`.
        world_size, rank: The FSDP2 data-parallel mesh (``None``: the default process group's, else one rank).
    """

    def __init__(
        self,
        layout: ParameterLayout,
        estimator: AdvantageEstimator,
        eps: float,
        dtype: torch.dtype,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> None:
        if world_size is None:
            world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed() else (1, 0)
        self.layout = ShardLayout(layout, world_size, rank or 0)
        self.groups = GroupAccumulator(self.layout, estimator, eps, dtype)
        """The shard statistics; :attr:`GroupAccumulator.held_numel` counts shard values."""
        self._staged: tuple[Contribution, Sequence[torch.Tensor]] | None = None
        self._closed: dict[str, GroupReduction] = {}

    def begin_batch(self) -> None:
        """Start a logical batch: check the parameters (:meth:`check_parameters`), then :meth:`reset`."""
        self.check_parameters()
        self.reset()

    def check_parameters(self) -> None:
        """Check that the parameters are FSDP2 shards over this layout's ranks, chunked as it assumes.

        Raises:
            ValueError: naming ``learner.shard_statistics`` and the mismatch.
        """
        from torch.distributed.tensor import DTensor, Shard

        parameters = self.layout.layout.parameters
        if not all(isinstance(p, DTensor) for p in parameters):
            raise ValueError(
                "learner.shard_statistics needs FSDP2 parameter shards (learner.strategy: fsdp) on every trainable "
                "parameter; set learner.shard_statistics: false for ddp or deepspeed"
            )
        for p in parameters:
            if p.device_mesh.size() != self.layout.world_size or tuple(p.placements) != (Shard(0),):
                raise ValueError(
                    f"learner.shard_statistics: a parameter is placed {tuple(p.placements)} on a mesh of "
                    f"{p.device_mesh.size()} rank(s); the statistics shard as Shard(0) over "
                    f"{self.layout.world_size} rank(s) (FSDP2 over all data-parallel ranks)"
                )
        self.layout.check_matches([p.to_local().shape for p in parameters])

    def stage(self, contribution: Contribution, grads: Sequence[torch.Tensor]) -> None:
        """Hold this pass's gradient (per-parameter, full shapes) for the next :meth:`exchange`.

        Raises:
            RuntimeError: if a gradient is already staged (one contribution per pass).
        """
        if self._staged is not None:
            raise RuntimeError("StatisticsShards.stage: a gradient is already staged; exchange() after every pass")
        self._staged = (contribution, grads)

    def exchange(self, send: bool = True) -> list[Contribution]:
        """Send every rank its shards of the staged gradients and fold in what arrives (a collective; see the module
        docstring); ``send=False`` drops this rank's staged gradient (its pass failed) and sends nothing. Returns the
        contributions folded here, in rank order."""
        contribution, grads = self._staged if self._staged is not None and send else (None, None)
        self._staged = None
        contributions = control_all_gather(contribution)
        if all(c is None for c in contributions):
            return []
        device, dtype = self.layout.layout.parameters[0].device, self.groups.dtype
        rows = None if grads is None else self.layout.scatter(grads, dtype, device)
        senders = [c is not None for c in contributions]  # an idle rank sends nothing
        received = all_to_all_rows(rows, senders, self.layout.numel, dtype, device)
        folded = [c for c in contributions if c is not None]
        for c, shard in zip(folded, received, strict=True):
            self._fold(c, shard.to(self.groups.batch.device))
        return folded

    def _fold(self, c: Contribution, shard: torch.Tensor) -> None:
        if c.group_id is None:
            self.groups.batch.add_(shard)
            return
        self.groups.add_flat(c.group_id, c.group_size, c.reward, shard)
        if self.groups.is_complete(c.group_id):
            self._closed[c.group_id] = self.groups.close(c.group_id)

    def close(self, group_id: str) -> GroupReduction:
        """The reduction of group ``group_id``, which closed here when its last source's shard was folded.

        Raises:
            RuntimeError: if the group has not closed (a source's gradient was never exchanged).
        """
        if group_id not in self._closed:
            raise RuntimeError(
                f"group {group_id!r} closed with {self.groups.folded(group_id)} source shard(s) folded in; every "
                "source's gradient must be exchanged before its group closes"
            )
        return self._closed.pop(group_id)

    def reset(self) -> None:
        """Start a new logical batch (see :meth:`GroupAccumulator.reset`)."""
        self.groups.reset()
        self._closed.clear()
        self._staged = None

    def norm(self, shard: torch.Tensor) -> float:
        """The global 2-norm of the vector whose shard on this rank is ``shard`` (a collective; padding is zero)."""
        square = torch.linalg.vector_norm(shard, dtype=torch.float64).reshape(1).cpu() ** 2
        return math.sqrt(float(control_all_reduce(square).item()))

    def write_grads(self, shard: torch.Tensor, scale: float) -> None:
        """Set each DTensor parameter's ``.grad`` to its local part of ``scale · shard`` (no communication)."""
        from torch.distributed.tensor import DTensor

        parameters = self.layout.layout.parameters
        for p, local in zip(parameters, self.layout.local_views(shard), strict=True):
            value = (local * scale).to(device=p.device, dtype=p.dtype)
            p.grad = DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())

    def gather(self, shard: torch.Tensor) -> torch.Tensor:
        """The whole vector from every rank's ``shard``, flat in :class:`ParameterLayout` order, on every rank (a
        collective; full-size, for checks and small models)."""
        if self.layout.world_size == 1:
            return self.layout.unshard(shard.reshape(1, -1))
        shards = [torch.empty_like(shard) for _ in range(self.layout.world_size)]
        dist.all_gather(shards, shard, group=control_group() if shard.device.type == "cpu" else None)
        return self.layout.unshard(torch.stack(shards))
