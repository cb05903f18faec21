"""Which learner rank serves which sources: GRPO groups and OPD trajectories, balanced by expected tokens.

With several learner ranks each rank streams only its own sources (Eq. 3's all-reduce sums their contributions at
the barrier). The unit of assignment is what must stay together on one rank:

* GRPO — a whole group: the advantages of Eq. 6 and the running sums G1, G2 of Eq. 7 need all m trajectories.
* OPD — a trajectory with all of its turns (a turn's causal context is its trajectory's earlier turns).
* GRPO with *spread* groups (``learner.shard_statistics``) — a trajectory: every rank folds every source's shard
  into its shard of G1/G2 (:mod:`tslightning.distributed.statistics_shards`), so a group need not stay on one rank.
  Its m trajectories are dealt round-robin (a counter over the plan's trajectories, group by group), so each group
  is spread over min(m, W) ranks and the ranks work on the same groups at once: the groups open anywhere stay
  ~k under an admission cap k instead of k·W.

Assignment is a pure function of the plan and the expected costs, so every rank computes the same one without a
collective. It is the longest-processing-time rule: units by decreasing expected tokens (ties by id) each go to the
rank with the least expected tokens so far (ties: fewer units, then the lower rank). Group counts per rank may
differ. Each rank's :class:`~tslightning.core.batch_registry.BatchPlan` keeps the global prompt count P, so the token
weights w = 1/(P·L_i) are the global ones; OPD's N_k is summed at the barrier.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

import torch

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.replay_batches import ReplayBatch
from tslightning.core.sources import BatchClosed, GroupClosed, StreamItem

Unit = tuple[str, int | None]
"""``(group_id, None)`` for a GRPO group, ``(group_id, trajectory_index)`` for an OPD or spread GRPO trajectory."""


def units_of(plan: BatchPlan, spread: bool = False) -> list[Unit]:
    """The assignment units of a whole-batch ``plan`` in registration order (``spread``: GRPO trajectories)."""
    if plan.objective is Objective.GRPO and not spread:
        return [(g, None) for g in plan.group_sizes]
    return [(g, i) for g in plan.group_sizes for i in sorted(plan.trajectory_indices(g))]


def round_robin(units: list[Unit], world_size: int) -> dict[Unit, int]:
    """Unit → rank dealt in order (unit n to rank n mod W): spreads each group's trajectories over the ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    return {unit: n % world_size for n, unit in enumerate(units)}


def balance(costs: Mapping[Unit, float], world_size: int) -> dict[Unit, int]:
    """Unit → rank by the longest-processing-time rule (deterministic; see the module docstring).

    Raises:
        ValueError: if ``world_size < 1`` or a cost is negative or not finite.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    bad = {u: c for u, c in costs.items() if not (math.isfinite(c) and c >= 0)}
    if bad:
        raise ValueError(f"expected token costs must be finite and >= 0; bad: {bad}")
    loads = [(0.0, 0, rank) for rank in range(world_size)]
    owners: dict[Unit, int] = {}
    for unit in sorted(costs, key=lambda u: (-costs[u], u[0], -1 if u[1] is None else u[1])):
        load, count, rank = min(loads)
        owners[unit] = rank
        loads[rank] = (load + costs[unit], count + 1, rank)
    return owners


@dataclass(frozen=True)
class RankAssignment:
    """The owner rank of every unit of one logical batch.

    Attributes:
        plan: The whole batch's plan (every group, on one rank's view: ``global_num_prompts`` unset or P).
        owners: Unit → global rank.
        world_size: Learner ranks.
        spread: GRPO groups are spread over ranks by trajectory (``learner.shard_statistics``).
    """

    plan: BatchPlan
    owners: Mapping[Unit, int]
    world_size: int
    spread: bool = False

    @classmethod
    def spread_groups(cls, plan: BatchPlan, world_size: int) -> RankAssignment:
        """Deal ``plan``'s GRPO trajectories round-robin over the ranks (:func:`round_robin`)."""
        if plan.objective is not Objective.GRPO:
            raise ValueError(f"spread groups are a GRPO assignment; got objective {plan.objective.value!r}")
        return cls(plan, round_robin(units_of(plan, spread=True), world_size), world_size, spread=True)

    @classmethod
    def balanced(cls, plan: BatchPlan, expected_tokens: Mapping[Unit, float], world_size: int) -> RankAssignment:
        """Assign ``plan``'s units by expected tokens; every unit of the plan needs a cost."""
        units = units_of(plan)
        missing = [u for u in units if u not in expected_tokens]
        if missing:
            raise ValueError(
                f"expected_tokens has no cost for units {missing[:8]}; give one per group (GRPO) or trajectory (OPD)"
            )
        return cls(plan, balance({u: float(expected_tokens[u]) for u in units}, world_size), world_size)

    def rank_plan(self, rank: int) -> BatchPlan:
        """Rank ``rank``'s plan: its groups (OPD, spread GRPO: its trajectories of each group) and the global P."""
        self._check_rank(rank)
        mine = [u for u in units_of(self.plan, self.spread) if self.owners[u] == rank]
        groups = dict.fromkeys(g for g, _ in mine)
        trajectories = None
        if self.plan.objective is Objective.OPD or self.spread:
            trajectories = {g: tuple(i for h, i in mine if h == g) for g in groups}
        return replace(
            self.plan,
            group_sizes={g: self.plan.group_sizes[g] for g in groups},
            global_num_prompts=self.plan.num_prompts,
            trajectories=trajectories,
        )

    def owns(self, rank: int, group_id: str, trajectory_index: int | None = None) -> bool:
        """Whether ``rank`` serves the group (GRPO) or the trajectory (OPD, spread GRPO) an item belongs to."""
        if (self.plan.objective is Objective.GRPO and not self.spread) or trajectory_index is None:
            return any(r == rank for (g, _), r in self.owners.items() if g == group_id)
        return self.owners.get((group_id, trajectory_index)) == rank

    def rank_items(self, items: Iterable[StreamItem], rank: int) -> list[StreamItem]:
        """The items rank ``rank`` ingests: its sources and events, a group's close where it holds a part, and
        BatchClosed everywhere."""
        self._check_rank(rank)
        kept = []
        for item in items:
            if isinstance(item, BatchClosed):
                kept.append(item)
            elif isinstance(item, GroupClosed):
                if self.owns(rank, item.group_id):
                    kept.append(item)
            elif self.owns(rank, item.group_id, item.trajectory_index):
                kept.append(item)
        return kept

    def units_per_rank(self) -> list[int]:
        """How many units each rank serves."""
        counts = [0] * self.world_size
        for rank in self.owners.values():
            counts[rank] += 1
        return counts

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}); got {rank}")


def recorded_tokens(batch: ReplayBatch) -> dict[Unit, float]:
    """Learner tokens per unit of a recorded batch: every source's full ``token_ids`` (context recomputed)."""
    costs: dict[Unit, float] = {u: 0.0 for u in units_of(batch.plan)}
    for item in batch.items:
        token_ids = getattr(item, "token_ids", None)
        if isinstance(token_ids, torch.Tensor):
            unit = (item.group_id, None if batch.plan.objective is Objective.GRPO else item.trajectory_index)
            costs[unit] += token_ids.numel()
    return costs


def split_replay_batch(
    batch: ReplayBatch, world_size: int, spread: bool = False
) -> tuple[RankAssignment, list[ReplayBatch]]:
    """Split a recorded whole batch over ``world_size`` ranks by recorded tokens (``spread``: GRPO trajectories
    round-robin, :meth:`RankAssignment.spread_groups`); item order is kept per rank."""
    if spread:
        assignment = RankAssignment.spread_groups(batch.plan, world_size)
    else:
        assignment = RankAssignment.balanced(batch.plan, recorded_tokens(batch), world_size)
    shares = [
        ReplayBatch(assignment.rank_plan(rank), tuple(assignment.rank_items(batch.items, rank)))
        for rank in range(world_size)
    ]
    return assignment, shares
