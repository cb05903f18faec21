"""One rank's shard of the flat gradient statistics, laid out like FSDP2's parameter shards.

FSDP2 (``fully_shard``) shards every parameter along dim 0 into ``world_size`` chunks as ``torch.chunk`` does:
``c = ceil(rows / world_size)`` rows each, the last ones shorter or empty, every chunk padded to ``c`` rows in its
flat buffer. A :class:`ShardLayout` keeps statistics the same way: rank r's shard of a flat statistic is, parameter
after parameter, the ``c_p`` rows of chunk r of parameter p (zero rows where the chunk is short). Every rank's shard
has the same length :attr:`ShardLayout.numel`, so a gradient unit's part for any rank
(:meth:`ShardLayout.unit_row`) has the same length on every rank (one step of the ring exchange sends one), and a
rank's shard of the batch accumulator is exactly its parameters' local DTensor shards
(:meth:`ShardLayout.local_views`): no all-reduce at the barrier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tslightning.core.parameter_layout import ParameterLayout


class ShardLayout:
    """Rank ``rank``'s shard, of ``world_size``, of flat statistics over ``layout``'s trainable parameters.

    Args:
        layout: The trainable parameters (their full shapes, recorded before sharding).
        world_size: Ranks sharing the statistics (FSDP2's data-parallel mesh size).
        rank: This rank's coordinate on that mesh.
    """

    def __init__(self, layout: ParameterLayout, world_size: int, rank: int) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"ShardLayout needs 0 <= rank < world_size; got rank {rank} of {world_size}")
        self.layout = layout
        self.world_size = world_size
        self.rank = rank
        self.statistics_device = layout.statistics_device
        self._rows: list[int] = []  # dim 0 of each parameter (1 for a scalar)
        self._row_numel: list[int] = []  # values per row
        self._chunk_rows: list[int] = []  # c_p = ceil(rows / world_size)
        self._offsets: list[int] = []  # where parameter p's chunk starts in a shard
        offset = 0
        for shape in layout.shapes:
            rows = shape[0] if len(shape) > 0 else 1
            row_numel = math.prod(shape[1:]) if len(shape) > 1 else 1
            chunk = math.ceil(rows / world_size)
            self._rows.append(rows)
            self._row_numel.append(row_numel)
            self._chunk_rows.append(chunk)
            self._offsets.append(offset)
            offset += chunk * row_numel
        self.numel = offset
        """Values in one rank's shard of one statistic, FSDP2's padding included (the same on every rank)."""

    @property
    def padding(self) -> int:
        """Padding values over all ranks' shards of one statistic: ``world_size · numel − layout.numel``."""
        return self.world_size * self.numel - self.layout.numel

    def local_rows(self, index: int, rank: int | None = None) -> int:
        """Rows of parameter ``index`` that ``rank`` (default: this rank) holds unpadded (FSDP2's local shard)."""
        rank = self.rank if rank is None else rank
        chunk = self._chunk_rows[index]
        return max(0, min(chunk, self._rows[index] - rank * chunk))

    def zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """A new zero shard where statistics live (host, page-locked on CUDA; or the parameters' device)."""
        if self.statistics_device == "device":
            return torch.zeros(self.numel, dtype=dtype, device=self.layout.parameters[0].device)
        return torch.zeros(self.numel, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())

    def placed(self, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` if it lives where statistics live now, else a new zero shard there."""
        if self.statistics_device == "device" and shard.device != self.layout.parameters[0].device:
            return self.zeros(shard.dtype)
        return shard

    def scatter(self, grads: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """One source's per-parameter gradients (full shapes) as a ``(world_size, numel)`` tensor on ``device``:
        row r is rank r's shard (every rank's part of a whole gradient at once; the learner sends a unit's parts
        one :meth:`unit_row` at a time)."""
        out = torch.zeros(self.world_size, self.numel, dtype=dtype, device=device)
        for index, g in enumerate(grads):
            flat, start, chunk = (
                g.detach().reshape(-1),
                self._offsets[index],
                self._chunk_rows[index] * self._row_numel[index],
            )
            for rank in range(self.world_size):
                length = self.local_rows(index, rank) * self._row_numel[index]
                out[rank, start : start + length].copy_(flat[rank * chunk : rank * chunk + length])
        return out

    def unit_numel(self, unit: Sequence[int]) -> int:
        """Values of one rank's part of a unit (its parameters' padded chunks): the length of a :meth:`unit_row`."""
        return sum(self._chunk_rows[i] * self._row_numel[i] for i in unit)

    def unit_row(
        self, unit: Sequence[int], grads: dict[int, torch.Tensor], rank: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Rank ``rank``'s part of one unit's gradients (``{parameter index: full-shape gradient}``; absent ones are
        zero) as a ``(unit_numel,)`` tensor on ``device``: its chunk of each parameter, parameter after parameter,
        padding zero."""
        out = torch.zeros(self.unit_numel(unit), dtype=dtype, device=device)
        start = 0
        for index in unit:
            chunk, row_numel = self._chunk_rows[index], self._row_numel[index]
            grad = grads.get(index)
            if grad is not None:
                length = self.local_rows(index, rank) * row_numel
                begin = rank * chunk * row_numel
                out[start : start + length].copy_(grad.detach().reshape(-1)[begin : begin + length])
            start += chunk * row_numel
        return out

    def unit_pieces(
        self, shard: torch.Tensor, unit: Sequence[int], row: torch.Tensor, alpha: float
    ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """Fold pieces (:mod:`~tslightning.core.unit_folding`) adding ``alpha · row`` — this rank's part of ``unit``,
        a :meth:`unit_row` — into ``shard``: one ``(view of shard, segment of row, alpha)`` per
        parameter."""
        pieces, start = [], 0
        for index in unit:
            length = self._chunk_rows[index] * self._row_numel[index]
            offset = self._offsets[index]
            pieces.append((shard[offset : offset + length], row[start : start + length], alpha))
            start += length
        return pieces

    def local_views(self, shard: torch.Tensor) -> list[torch.Tensor]:
        """Views of this rank's ``shard``, one per parameter, each in the shape of its local (unpadded) FSDP2 shard."""
        views = []
        for index, shape in enumerate(self.layout.shapes):
            rows = self.local_rows(index)
            start = self._offsets[index]
            local = shard[start : start + rows * self._row_numel[index]]
            views.append(local.view(rows, *shape[1:]) if len(shape) > 0 or rows == 0 else local.view(shape))
        return views

    def unshard(self, shards: torch.Tensor) -> torch.Tensor:
        """Every rank's shard, ``(world_size, numel)``, as one flat vector in :class:`ParameterLayout` order."""
        pieces = []
        for index in range(len(self.layout.shapes)):
            rows, row_numel, chunk = self._rows[index], self._row_numel[index], self._chunk_rows[index]
            start = self._offsets[index]
            padded = shards[:, start : start + chunk * row_numel].reshape(self.world_size * chunk * row_numel)
            pieces.append(padded[: rows * row_numel])
        return torch.cat(pieces)

    def check_matches(self, local_shapes: Sequence[torch.Size | None]) -> None:
        """Check that FSDP2's local shards have the shapes this layout gives this rank (``None``: not sharded).

        Raises:
            ValueError: naming the first parameter whose local shard differs.
        """
        for index, (shape, local) in enumerate(zip(self.layout.shapes, local_shapes, strict=True)):
            expected = torch.Size([self.local_rows(index), *shape[1:]]) if len(shape) > 0 else shape
            if local is not None and torch.Size(local) != expected:
                raise ValueError(
                    f"learner.shard_statistics: parameter {index} of shape {tuple(shape)} has a local FSDP2 shard of "
                    f"{tuple(local)} on rank {self.rank}, not the dim-0 chunk {tuple(expected)}; the statistics can "
                    "only be sharded like fully_shard's default Shard(0) placement"
                )
