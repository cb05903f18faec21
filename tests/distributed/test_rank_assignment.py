"""Rank assignment: deterministic, balanced by expected tokens, whole groups (GRPO) and trajectories (OPD) per rank."""

from __future__ import annotations

import pytest
import torch

from tslightning.core.batch_registry import BatchPlan, BatchRegistry, Objective
from tslightning.core.replay_batches import WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.core.sources import BatchClosed, SourceError, TrajectorySource, TurnSource
from tslightning.distributed.rank_assignment import (
    RankAssignment,
    balance,
    recorded_tokens,
    split_replay_batch,
    units_of,
)
from tslightning.distributed.rank_failure import agree_to_step, reported_to_ranks
from tslightning.learner.spread_groups import spread_groups

SHAPE = WorkloadShape(num_groups=5, group_size=3, max_turns=3)


def test_balance_is_longest_processing_time_first_and_order_independent():
    costs = {("a", None): 5.0, ("b", None): 4.0, ("c", None): 3.0, ("d", None): 3.0, ("e", None): 1.0}
    owners = balance(costs, 2)
    assert owners == {("a", None): 0, ("b", None): 1, ("c", None): 1, ("d", None): 0, ("e", None): 1}
    loads = [sum(c for u, c in costs.items() if owners[u] == r) for r in (0, 1)]
    assert loads == [8.0, 8.0]  # balanced tokens with 2 vs 3 groups
    assert balance(dict(reversed(list(costs.items()))), 2) == owners


def test_equal_costs_spread_counts_and_extra_ranks_stay_empty():
    costs = {(f"g{i}", None): 1.0 for i in range(5)}
    assert sorted(list(balance(costs, 2).values()).count(r) for r in (0, 1)) == [2, 3]
    assert sorted(balance(costs, 7).values()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("bad", [{("g", None): -1.0}, {("g", None): float("nan")}])
def test_balance_rejects_bad_costs(bad):
    with pytest.raises(ValueError, match="finite and >= 0"):
        balance(bad, 2)


def test_grpo_ranks_get_whole_groups_and_the_global_prompt_count(vocab_size):
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(1), SHAPE)
    assignment, shares = split_replay_batch(batch, 2)
    groups = [set(share.plan.group_sizes) for share in shares]
    assert groups[0].isdisjoint(groups[1]) and groups[0] | groups[1] == set(batch.plan.group_sizes)
    assert all(share.plan.num_prompts == 5 for share in shares)  # w = 1/(P·L_i) with the global P
    for share in shares:
        sources = [i for i in share.items if isinstance(i, TrajectorySource)]
        assert {s.group_id for s in sources} == set(share.plan.group_sizes)
        assert len(sources) == 3 * len(share.plan.group_sizes)  # every trajectory of a group on its rank
        _replay_through_registry(share)
    costs = recorded_tokens(batch)
    loads = [sum(costs[(g, None)] for g in group_set) for group_set in groups]
    assert max(loads) - min(loads) <= max(costs.values())  # LPT: within one unit of balance
    assert assignment.units_per_rank() == [len(g) for g in groups]


def test_spread_grpo_groups_deal_each_group_over_the_ranks(vocab_size):
    """Spread (sharded statistics): trajectories round-robin, so every rank holds part of every group (m >= W)."""
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(1), SHAPE)
    assignment, shares = split_replay_batch(batch, 2, spread=True)
    assert units_of(batch.plan, spread=True) == [(g, i) for g in batch.plan.group_sizes for i in range(3)]
    assert assignment.units_per_rank() == [8, 7]  # 15 trajectories dealt in turn
    held = {}
    for rank, share in enumerate(shares):
        assert list(share.plan.group_sizes) == list(batch.plan.group_sizes)  # every group, in plan order
        assert dict(share.plan.group_sizes) == dict(batch.plan.group_sizes)  # the global m for the advantage
        assert share.plan.num_prompts == 5
        sources = [i for i in share.items if isinstance(i, TrajectorySource)]
        for s in sources:
            assert assignment.owns(rank, s.group_id, s.trajectory_index)
            assert not assignment.owns(1 - rank, s.group_id, s.trajectory_index)
            held.setdefault(s.group_id, set()).add((rank, s.trajectory_index))
        assert {s.trajectory_index for s in sources if s.group_id == "group-0"} == set(
            share.plan.trajectory_indices("group-0")
        )
        _replay_through_registry(share)  # a partial group closes in this rank's registry
    for pairs in held.values():
        assert {r for r, _ in pairs} == {0, 1} and sorted(i for _, i in pairs) == [0, 1, 2]
    whole, _ = split_replay_batch(batch, 2)
    assert not whole.spread and all(i is None for _, i in whole.owners)  # spreading is opt-in: whole groups
    with pytest.raises(ValueError, match="spread groups are a GRPO assignment"):
        RankAssignment.spread_groups(BatchPlan(Objective.OPD, 0, {"g": 2}), 2)


def test_opd_trajectories_keep_all_turns_on_one_rank(vocab_size, teacher64):
    batch = synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(2), teacher64, SHAPE)
    _, shares = split_replay_batch(batch, 3)
    owner: dict[tuple[str, int], int] = {}
    for rank, share in enumerate(shares):
        for item in share.items:
            if isinstance(item, TurnSource):
                assert owner.setdefault((item.group_id, item.trajectory_index), rank) == rank
        _replay_through_registry(share)
    assert len(owner) == 15 and set(owner.values()) == {0, 1, 2}
    split_groups = [g for g in batch.plan.group_sizes if len({r for (h, _), r in owner.items() if h == g}) > 1]
    assert split_groups  # OPD groups are split by trajectory, which GRPO never does
    turns = sum(isinstance(i, TurnSource) for share in shares for i in share.items)
    assert turns == sum(isinstance(i, TurnSource) for i in batch.items)


def test_a_rank_without_sources_still_closes_its_batch():
    plan = BatchPlan(Objective.GRPO, 0, {"only": 2})
    assignment = RankAssignment(plan, {("only", None): 0}, world_size=2)
    empty = assignment.rank_plan(1)
    assert dict(empty.group_sizes) == {} and empty.num_prompts == 1
    registry = BatchRegistry(empty)
    registry.check(BatchClosed(0))
    registry.record(BatchClosed(0))
    registry.require_complete()
    with pytest.raises(SourceError, match="group_sizes is empty"):
        BatchPlan(Objective.GRPO, 0, {})


def test_plan_trajectories_are_validated_and_foreign_turns_rejected(vocab_size, teacher64):
    split = BatchPlan(Objective.GRPO, 0, {"g": 2}, trajectories={"g": (0,)})  # spread groups (sharded statistics)
    assert split.trajectory_indices("g") == frozenset({0}) and split.num_trajectories == 1
    with pytest.raises(SourceError, match="GRPO groups over ranks, which needs learner.shard_statistics"):
        spread_groups(split, None, None, print)  # the learner refuses it without sharded statistics
    with pytest.raises(SourceError, match="distinct indices"):
        BatchPlan(Objective.OPD, 0, {"g": 2}, trajectories={"g": (0, 2)})
    batch = synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(3), teacher64, SHAPE)
    assignment, shares = split_replay_batch(batch, 2)
    foreign = next(i for i in shares[1].items if isinstance(i, TurnSource) and i.group_id in shares[0].plan.group_sizes)
    registry = BatchRegistry(shares[0].plan)
    with pytest.raises(SourceError, match="belongs to another learner rank"):
        registry.check(foreign)
    assert set(units_of(shares[0].plan)) == {u for u, r in assignment.owners.items() if r == 0}


def test_failure_reporting_is_transparent_on_one_process():
    agree_to_step(0)  # no collective without a process group
    with pytest.raises(KeyError, match="original"):
        with reported_to_ranks(0):
            raise KeyError("original")


def _replay_through_registry(share) -> None:
    registry = BatchRegistry(share.plan)
    for item in share.items:
        registry.check(item)
        registry.record(item)
    registry.require_complete()
