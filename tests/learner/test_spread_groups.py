"""Spread GRPO groups: global admission in plan order, refusals, and the sync rewards of a split group."""

from __future__ import annotations

import pytest
import torch

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.sources import GroupClosed, SourceError, TrajectorySource
from tslightning.distributed.statistics_shards import StatisticsShards
from tslightning.learner.spread_groups import SpreadGroups, global_rewards, spread_groups
from tslightning.learner.sync_direction import trajectory_coefficients
from tslightning.objectives.advantages import GRPO_EPSILON, AdvantageEstimator


def _source(group_id: str, index: int, reward: float = 1.0, length: int = 4) -> TrajectorySource:
    tokens = torch.arange(length)
    mask = torch.tensor([False] + [True] * (length - 1))
    return TrajectorySource(group_id, index, tokens, mask, reward, 0, 1)


def _keys(sources: list[TrajectorySource]) -> list[tuple[str, int]]:
    return [(s.group_id, s.trajectory_index) for s in sources]


def _shards(world_size: int) -> StatisticsShards:
    layout = ParameterLayout([torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))])
    grpo = (Objective.GRPO, AdvantageEstimator.GRPO, GRPO_EPSILON, torch.float64)
    return StatisticsShards(layout, *grpo, world_size=world_size, rank=0)


def test_admission_follows_plan_order_and_the_global_closes():
    plan = BatchPlan(Objective.GRPO, 0, {"a": 2, "b": 2, "c": 2}, trajectories={g: (0,) for g in "abc"})
    served = []
    spread = SpreadGroups(plan, 1, served.append)
    spread.offer(_source("b", 0))
    spread.offer(_source("c", 0))
    assert served == [] and spread.num_waiting == 2  # only "a", the first open group, is admitted
    spread.offer(_source("a", 0))
    spread.offer(GroupClosed("a"))  # this rank's part arrived; the group stays open until every rank's is folded
    assert _keys(served) == [("a", 0)] and spread.admitted("a") and not spread.admitted("b")
    spread.closed("a")  # the exchange folded a's last source (on any rank)
    assert _keys(served) == [("a", 0), ("b", 0)] and spread.num_waiting == 1
    spread.closed("b")
    assert _keys(served)[-1] == ("c", 0) and spread.num_waiting == 0


def test_without_a_cap_every_source_is_served_at_once():
    plan = BatchPlan(Objective.GRPO, 0, {"a": 2, "b": 2}, trajectories={"a": (1,), "b": (0,)})
    served = []
    spread = SpreadGroups(plan, None, served.append)
    spread.offer(_source("b", 0))
    spread.offer(_source("a", 1))
    assert [s.group_id for s in served] == ["b", "a"]


def test_spread_groups_is_chosen_by_the_plan_and_refuses_what_it_cannot_count():
    whole = BatchPlan(Objective.GRPO, 0, {"a": 2})
    split = BatchPlan(Objective.GRPO, 0, {"a": 2}, global_num_prompts=2, trajectories={"a": (0,)})
    shards = _shards(2)
    assert spread_groups(whole, shards, 1, print) is None and shards.on_close is None
    assert spread_groups(split, _shards(1), 1, print) is None  # one rank holds every trajectory
    spread = spread_groups(split, shards, None, print)
    assert isinstance(spread, SpreadGroups) and shards.on_close == spread.closed
    with pytest.raises(SourceError, match=r"this rank holds 1 of 2 \(use samples_per_prompt >= learner ranks\)"):
        spread_groups(split, shards, 1, print)
    with pytest.raises(SourceError, match="needs learner.shard_statistics"):
        spread_groups(split, None, None, print)


def test_a_split_group_gets_the_advantages_of_all_its_rewards():
    """Rank 0 holds trajectories 0 and 2 of a group of 3: its weights are the whole group's, m = 3."""
    rewards = [0.0, 1.0, 0.25]
    everyone = [_source("g", i, r, 4 + i) for i, r in enumerate(rewards)]
    plan = BatchPlan(Objective.GRPO, 0, {"g": 3})
    whole, reductions = trajectory_coefficients(everyone, plan, AdvantageEstimator.RLOO, GRPO_EPSILON)
    mine = [everyone[0], everyone[2]]
    gathered = global_rewards(mine, None, 0)  # one process: only its own sources
    assert gathered == {"g": {0: 0.0, 2: 0.25}}
    part, part_reductions = trajectory_coefficients(
        mine, plan, AdvantageEstimator.RLOO, GRPO_EPSILON, {"g": dict(enumerate(rewards))}
    )
    assert part == [whole[0], whole[2]] and part_reductions == reductions
    alone, _ = trajectory_coefficients(mine, plan, AdvantageEstimator.RLOO, GRPO_EPSILON)
    assert alone != part  # the two local rewards alone give other advantages
