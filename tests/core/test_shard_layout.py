"""A rank's shard of flat statistics is FSDP2's dim-0 chunk of every parameter (``torch.chunk``), padded alike."""

from __future__ import annotations

import math

import pytest
import torch

from tslightning.core.group_accumulator import GroupAccumulator
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.shard_layout import ShardLayout

SHAPES = [(5, 3), (7,), (1, 4), (8, 2, 2), ()]
"""Rows that do not divide by the ranks (5, 7), fewer rows than ranks (1), a 3-d tensor and a scalar."""


def _layout() -> ParameterLayout:
    generator = torch.Generator().manual_seed(0)
    return ParameterLayout(
        [torch.nn.Parameter(torch.randn(s, generator=generator, dtype=torch.float64)) for s in SHAPES]
    )


def _grads(layout: ParameterLayout, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=generator, dtype=torch.float64) for s in layout.shapes]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_rank_shard_holds_torch_chunk_of_every_parameter(world_size):
    layout = _layout()
    grads = _grads(layout, 1)
    rows = ShardLayout(layout, world_size, 0).scatter(grads, torch.float64, torch.device("cpu"))
    assert rows.shape == (world_size, ShardLayout(layout, world_size, 0).numel)
    for rank in range(world_size):
        shards = ShardLayout(layout, world_size, rank)
        for g, local in zip(grads, shards.local_views(rows[rank]), strict=True):
            chunks = torch.chunk(g.reshape(-1, *g.shape[1:]) if g.dim() else g.reshape(1), world_size)
            expected = chunks[rank] if rank < len(chunks) else g.reshape(-1, *g.shape[1:])[:0]
            assert torch.equal(local.reshape(expected.shape), expected)
    assert torch.equal(shards.unshard(rows), torch.cat([g.reshape(-1) for g in grads]))


def test_every_shard_has_the_same_length_with_fsdp2_padding():
    layout = _layout()
    shards = ShardLayout(layout, 4, 3)
    expected = sum(math.ceil((s[0] if s else 1) / 4) * math.prod(s[1:]) for s in SHAPES)
    assert shards.numel == expected and shards.padding == 4 * expected - layout.numel > 0
    assert [shards.local_rows(i) for i in range(len(SHAPES))] == [0, 1, 0, 2, 0]  # 5 rows: chunks of 2, 2, 1, none
    rows = shards.scatter(_grads(layout, 2), torch.float64, torch.device("cpu"))
    assert float(rows.abs().sum()) > 0 and shards.zeros(torch.float64).shape == (expected,)


def test_check_matches_names_a_local_shard_of_another_shape():
    shards = ShardLayout(_layout(), 2, 1)
    shards.check_matches([torch.Size([2, 3]), torch.Size([3]), torch.Size([0, 4]), torch.Size([4, 2, 2]), None])
    with pytest.raises(ValueError, match=r"parameter 0 of shape \(5, 3\) has a local FSDP2 shard of \(3, 3\)"):
        shards.check_matches([torch.Size([3, 3]), torch.Size([3]), torch.Size([0, 4]), torch.Size([4, 2, 2]), None])


def test_group_statistics_folded_as_shards_equal_the_whole_statistics():
    """Folding each rank's shard of every source, then closing, gives each rank's shard of the whole g_k."""
    layout = _layout()
    whole = GroupAccumulator(layout, dtype=torch.float64)
    ranks = [GroupAccumulator(ShardLayout(layout, 3, r), dtype=torch.float64) for r in range(3)]
    sources = [("a", 1.0), ("b", 0.25), ("a", 0.0), ("b", 0.75), ("a", 2.0), ("b", 0.25)]
    for index, (group, reward) in enumerate(sources):
        grads = _grads(layout, 10 + index)
        whole.add(group, 3, reward, grads)
        rows = ShardLayout(layout, 3, 0).scatter(grads, torch.float64, torch.device("cpu"))
        for rank, accumulator in enumerate(ranks):
            accumulator.add_flat(group, 3, reward, rows[rank])
            if accumulator.is_complete(group):
                accumulator.close(group)
        if whole.is_complete(group):
            whole.close(group)
    assert whole.batch.abs().sum() > 0
    gathered = ShardLayout(layout, 3, 0).unshard(torch.stack([a.batch for a in ranks]))
    assert torch.allclose(gathered, whole.batch, rtol=1e-13, atol=1e-15)
    assert ranks[0].peak_held_numel == 5 * ranks[0].layout.numel  # two open groups: (2·2 + 1) shards


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_a_unit_row_is_that_rank_s_part_of_the_unit_in_its_shard_layout(world_size):
    """What one ring step sends: rank r's chunks of the unit's parameters, padded as in r's shard, absent ones zero."""
    layout = _layout()
    grads = _grads(layout, 3)
    unit = [1, 2, 3]
    given = {1: grads[1], 3: grads[3]}  # parameter 2 got no gradient this pass
    rows = ShardLayout(layout, world_size, 0).scatter(
        [g if i in given else torch.zeros_like(g) for i, g in enumerate(grads)], torch.float64, torch.device("cpu")
    )
    for rank in range(world_size):
        shards = ShardLayout(layout, world_size, rank)
        row = shards.unit_row(unit, given, rank, torch.float32, torch.device("cpu"))
        assert row.dtype == torch.float32 and row.numel() == shards.unit_numel(unit)
        folded = shards.zeros(torch.float64)
        for view, values, alpha in shards.unit_pieces(folded, unit, row.double(), 1.0):
            view.add_(values, alpha=alpha)
        start, end = shards._offsets[1], shards._offsets[4]
        assert torch.equal(folded[start:end], rows[rank, start:end].float().double())
        assert float(folded[:start].abs().sum()) == 0 and float(folded[end:].abs().sum()) == 0
