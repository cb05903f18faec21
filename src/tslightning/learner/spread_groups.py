"""GRPO groups spread over learner ranks under sharded statistics (``learner.shard_statistics``).

Whole groups per rank leave each rank's shards holding the statistics of every rank's open groups: k·W groups under
a per-rank admission cap k. Spread, a group's m trajectories are dealt over the ranks
(:meth:`~tslightning.distributed.rank_assignment.RankAssignment.spread_groups`) and the ranks work on the same
groups at once:

* **Admission counts groups globally.** A trajectory of group g is folded only once g is among the first k groups,
  in plan order, that have not closed; later groups' sources wait (their tokens only, never their rewards). Every
  rank holds every group (m ≥ W) in the same plan order and sees the same closes (below), so all ranks agree on the
  open groups without a message of their own, and at most k groups hold statistics anywhere.
* **A group closes on its global count.** :class:`~tslightning.distributed.statistics_shards.StatisticsShards`
  closes a group on every rank at the exchange that folds its m-th source, whichever rank served it; that close
  releases the next waiting group. A rank's own :class:`GroupClosed` only tells its registry that its part arrived.
* **Sync batches gather the rewards.** The batch-form advantages of Eq. 6 need all m rewards of a group: one
  control all-gather of (group, index, reward) per barrier, once every rank has reached it.
"""

from __future__ import annotations

from collections.abc import Callable

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.group_accumulator import GroupReduction
from tslightning.core.sources import GroupClosed, SourceError, TrajectorySource
from tslightning.distributed.collectives import control_all_gather
from tslightning.distributed.lockstep import LockstepTicks
from tslightning.distributed.statistics_shards import StatisticsShards

Start = Callable[[TrajectorySource], None]
"""Queues an admitted source's learner work (the module's ``_serve_trajectory``: a pass per sequence)."""


def spread_groups(
    plan: BatchPlan, shards: StatisticsShards | None, cap: int | None, start: Start
) -> SpreadGroups | None:
    """The batch's :class:`SpreadGroups` when ``plan`` splits GRPO groups over ranks (``None`` otherwise); an
    admitted source's work is queued with ``start``.

    Raises:
        SourceError: for a split GRPO group without sharded statistics, or a global cap that some rank could not
            count (a rank missing a group: group size m below the learner ranks).
    """
    if shards is not None:
        shards.on_close = None
    if plan.objective is not Objective.GRPO or plan.trajectories is None:
        return None
    if shards is None:
        raise SourceError(
            "BatchPlan.trajectories splits GRPO groups over ranks, which needs learner.shard_statistics (every rank "
            "folds every source's shard); without it give whole groups (trajectories None)"
        )
    if shards.layout.world_size == 1:
        return None  # one rank holds every trajectory: whole groups
    if cap is not None and len(plan.group_sizes) != plan.num_prompts:
        raise SourceError(
            f"group_admission_cap counts spread groups globally, so every rank must hold a part of every group; this "
            f"rank holds {len(plan.group_sizes)} of {plan.num_prompts} (use samples_per_prompt >= learner ranks)"
        )
    spread = SpreadGroups(plan, cap, start)
    shards.on_close = spread.closed
    return spread


class SpreadGroups:
    """One logical batch's global admission of spread GRPO groups (see the module docstring).

    Args:
        plan: This rank's plan (its trajectories of each group; group order is the global plan order).
        cap: Admission cap k, counted over all ranks (``None``: no cap).
        start: Queues an admitted source's work.
    """

    def __init__(self, plan: BatchPlan, cap: int | None, start: Start) -> None:
        self.plan = plan
        self.cap = cap
        self._start = start
        self._open_order = list(plan.group_sizes)  # groups not yet closed, in plan order
        self._waiting: dict[str, list[TrajectorySource]] = {}

    def admitted(self, group_id: str) -> bool:
        """Whether ``group_id`` is among the first ``cap`` groups not yet closed (always, without a cap)."""
        return self.cap is None or group_id in self._open_order[: self.cap]

    def offer(self, item: TrajectorySource | GroupClosed) -> None:
        """Serve a source now if its group is admitted, else hold it; a :class:`GroupClosed` changes nothing here."""
        if isinstance(item, GroupClosed):
            return
        if self.admitted(item.group_id):
            self._start(item)
        else:
            self._waiting.setdefault(item.group_id, []).append(item)

    def closed(self, group_id: str) -> None:
        """Group ``group_id`` closed on every rank: serve the waiting sources of the groups it admits."""
        if group_id in self._open_order:
            self._open_order.remove(group_id)
        for g in [g for g in self._waiting if self.admitted(g)]:
            for source in self._waiting.pop(g):
                self._start(source)

    @property
    def num_waiting(self) -> int:
        """Sources held back by the cap."""
        return sum(len(sources) for sources in self._waiting.values())

    def reductions(self, shards: StatisticsShards) -> list[GroupReduction]:
        """The reductions of this rank's groups, once every rank's sources are exchanged (after the drain)."""
        return [shards.close(g) for g in self.plan.group_sizes]


def global_rewards(
    sources: list[TrajectorySource], lockstep: LockstepTicks | None, update: int
) -> dict[str, dict[int, float]]:
    """Every rank's (group → trajectory index → reward) of its held ``sources``, merged (a control all-gather).

    Ranks tick once per ingested item, so they reach the barrier after different numbers of ticks: ``lockstep`` is
    drained first (every rank at the barrier, no work queued), then all ranks enter the gather together.
    """
    if lockstep is not None:
        lockstep.drain(update)
    rewards: dict[str, dict[int, float]] = {}
    for share in control_all_gather([(s.group_id, s.trajectory_index, s.reward) for s in sources]):
        for group_id, index, reward in share:
            rewards.setdefault(group_id, {})[index] = reward
    return rewards
