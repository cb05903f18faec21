"""Streaming statistics sharded like FSDP2's parameters (``learner.shard_statistics``): each rank holds only its shard.

Unsharded, every rank keeps G1' and G2 of each of its open groups and the batch accumulator whole:
``(2·open + 1) · numel`` values per rank, ~84 GB at 7B. Sharded, rank j keeps shard j (FSDP2's dim-0 chunks, padded;
:class:`~tslightning.core.shard_layout.ShardLayout`) of the statistics of *every* open group, whichever rank serves
it: ``(2·open + 1) · numel / world`` (+ padding), ``open`` counted over all ranks. OPD's one sum shards the same way.

Folding, one lock-step pass at a time (:mod:`tslightning.distributed.lockstep`), *unit by unit while the backward
runs* (:class:`~tslightning.core.unit_backward.UnitBackward`), so no rank ever holds a source's whole gradient:

1. :meth:`StatisticsShards.begin_pass`: every rank's :class:`~tslightning.core.contribution.Contribution` (its
   source's group, group size and reward; the batch accumulator; or ``None`` for an idle pass) is all-gathered, a
   control message — every rank then knows what each rank's gradient is for;
2. for each gradient unit as the backward completes it, in the fixed fold order (the same on every rank):
   :meth:`StatisticsShards.exchange_unit` passes the unit's shards around a ring — at step s every rank sends its
   chunk for rank ``rank + s`` and receives the chunk rank ``rank − s`` sent (an idle rank sends nothing), one
   ``all_to_all_single`` with two non-zero splits — and folds each arrival (its own chunk first) into its shard of
   the right statistics (Eq. 7's two axpys, or the batch sum) before the next step. The unit's gradient is then
   dropped: a rank holds one unit unsharded plus one row sent and one received, 1/world of a unit each — gradient
   memory of one unit and two shards, whatever the model's size, the shards falling as 1/world;
3. :meth:`StatisticsShards.end_pass`: each folded source is counted in its group, and a group closes on every rank
   once all m of its sources are folded (all m rewards travelled with them: μ and a_G are known everywhere).

Why this is the batch-synchronous update: shard j of a gradient is a fixed set of coordinates, and rank j applies to
them exactly the operations the unsharded accumulator applies to the same coordinates — ``G1'_G += (r_i − c) H_i``,
``G2_G += H_i`` for each source, ``g_k += (a_G/m)(G1' − (μ − c)G2)`` at each close — with the same values (each unit's
gradient is the one ``torch.autograd.grad`` returns). Only the order of additions across sources differs from a
batch-synchronous sum, the rounding of any streamed order (float64 tests: ≤ 1e-12).

At the barrier the rank's accumulator shard *is* its part of g_k: its norm is one all-reduce of a float64 scalar, and
each DTensor parameter's ``.grad`` is the matching view of the shard (no all-reduce of the direction).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from tslightning.core.batch_registry import Objective
from tslightning.core.contribution import Contribution
from tslightning.core.folding_queue import FoldingQueue
from tslightning.core.group_accumulator import GroupReduction
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.shard_layout import ShardLayout
from tslightning.core.streaming_statistics import StreamingStatistics
from tslightning.core.unit_folding import UnitFolder
from tslightning.distributed.collectives import (
    control_all_gather,
    control_all_reduce,
    control_group,
    distributed,
    send_receive,
)
from tslightning.objectives.advantages import AdvantageEstimator


class StatisticsShards:
    """This rank's shard of the streaming statistics (every open GRPO group's and the batch accumulator; OPD's sum).

    Args:
        layout: The trainable parameters (full shapes).
        objective, estimator, eps, dtype: As for :class:`~tslightning.core.streaming_statistics.StreamingStatistics`.
        folding: The folding thread (``learner.fold_queue_depth``), or ``None``: fold on the learner thread.
        world_size, rank: The FSDP2 data-parallel mesh (``None``: the default process group's, else one rank).
    """

    def __init__(
        self,
        layout: ParameterLayout,
        objective: Objective,
        estimator: AdvantageEstimator,
        eps: float,
        dtype: torch.dtype,
        folding: FoldingQueue | None = None,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> None:
        if world_size is None:
            world_size, rank = (dist.get_world_size(), dist.get_rank()) if distributed() else (1, 0)
        self.layout = ShardLayout(layout, world_size, rank or 0)
        self.statistics = StreamingStatistics(self.layout, objective, estimator, eps, dtype, folding)
        """The shard statistics; their ``held_numel`` counts shard values."""
        self.groups = self.statistics.groups
        self.folder = UnitFolder(folding, max(self.layout.unit_numel(unit) for unit in layout.units))
        self._closed: dict[str, GroupReduction] = {}
        self.peak_exchange_numel = 0
        """Most gradient values one unit's exchange held at once: this rank's unit gradient, the rows it sent and
        the rows it received."""
        self.on_close: Callable[[str], None] | None = None
        """Called with a group's id when it closes here (its last source's shard folded): the same exchange on
        every rank, so ranks that spread groups agree on which groups are open."""

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

    def begin_pass(self, contribution: Contribution | None) -> list[Contribution | None]:
        """Every rank's contribution for this lock-step pass, in rank order (a control all-gather; ``None``: an idle
        pass, which sends nothing)."""
        return control_all_gather(contribution)

    def exchange_unit(
        self,
        contributions: Sequence[Contribution | None],
        unit: Sequence[int],
        grads: dict[int, torch.Tensor] | None,
        device: torch.device,
        fold: bool = True,
    ) -> None:
        """Exchange one unit's gradient shards around the ring and fold each arrival into this rank's shard statistics
        (a collective: every rank, every unit, in the fold order). ``grads`` ``None`` for an idle pass, which sends
        nothing; ``fold`` ``False`` only completes the exchange (a failed pass's, for its peers). A fold that raises
        is raised once every step has run, so no peer is left waiting in one.

        Step s of ``world_size``: send the chunk of rank ``rank + s`` and receive the chunk rank ``rank − s`` sent
        (step 0 is this rank's own chunk), folded before the next step. A step holds one row sent and one received,
        ``unit_numel`` values each: 1/world of the unit."""
        senders = [c is not None for c in contributions]
        if not any(senders):
            return
        world, rank = self.layout.world_size, self.layout.rank
        dtype, numel = self.statistics.dtype, self.layout.unit_numel(unit)
        produced = sum(g.numel() for g in (grads or {}).values())
        failure: BaseException | None = None
        for step in range(world):
            to, source = (rank + step) % world, (rank - step) % world
            row = None if grads is None else self.layout.unit_row(unit, grads, to, dtype, device)
            sent = 0 if row is None else row.numel()
            if step > 0:
                row = send_receive(row, to, source if senders[source] else None, numel, dtype, device)
            received = 0 if row is None or step == 0 else row.numel()
            self.peak_exchange_numel = max(self.peak_exchange_numel, produced + sent + received)
            if fold and failure is None and row is not None:
                try:
                    self.fold_received(contributions[source], unit, row)
                except BaseException as error:  # the peers wait in the next steps: finish them, then fail
                    failure = error
        if failure is not None:
            raise failure

    def fold_received(self, contribution: Contribution, unit: Sequence[int], row: torch.Tensor) -> None:
        """Fold ``row`` — this rank's chunk of ``unit`` of ``contribution``'s source gradient — into this rank's
        shard statistics."""
        pieces = []
        for statistic, alpha in self.statistics.terms(contribution):
            pieces += self.layout.unit_pieces(statistic, unit, row, alpha)
        self.folder.fold(pieces)

    def end_pass(self, contributions: Sequence[Contribution | None]) -> None:
        """Count every folded source in its group; close the groups whose m-th source this pass folded."""
        for c in contributions:
            if c is None or c.group_id is None or not c.completes:
                continue
            self.statistics.record(c)
            if self.groups.is_complete(c.group_id):
                self._closed[c.group_id] = self.groups.close(c.group_id)
                if self.on_close is not None:
                    self.on_close(c.group_id)

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
        self.statistics.reset()
        self._closed.clear()

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
