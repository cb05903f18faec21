"""Registration and completion state of one logical batch (Algorithm 1, lines 3, 12 and 24).

Before an update starts, every group of the logical batch B_k is registered with its size. The registry then
follows sources and completion events as they arrive and answers one question for the barrier: is every
registered trajectory, group and turn closed? It never touches gradients: :meth:`BatchRegistry.check` only
validates, :meth:`BatchRegistry.record` only records, so callers validate, compute, then record — and a
rejected item leaves every piece of learner state exactly as it was.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from tslightning.core.sources import (
    BatchClosed,
    GroupClosed,
    PolicyVersionError,
    SourceError,
    StreamItem,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
    check_int,
)


class Objective(StrEnum):
    """The training objective, which fixes what a source is (§3.4)."""

    GRPO = "grpo"
    OPD = "opd"


@dataclass(frozen=True)
class BatchPlan:
    """What one logical batch B_k will contain, registered before its first source.

    Attributes:
        objective: GRPO (a source is a trajectory) or OPD (a source is a teacher-scored turn); the strings ``"grpo"``
            and ``"opd"`` are accepted and stored as the :class:`Objective`.
        policy_version: k, the version of θ_k that samples and is differentiated in this batch.
        group_sizes: group id → number of trajectories m sampled for that prompt (this rank's groups).
        global_num_prompts: P of the token weights 1/(P·L_i) (App. D.1) across all learner ranks; ``None``
            means this rank holds the whole batch, P = ``len(group_sizes)``. A rank may hold no group at all
            (more ranks than groups) only when this is given.
        trajectories: OPD, or GRPO with spread groups, on several ranks: group id → the trajectory indices of that
            group this rank serves (each trajectory, with all of its turns, lives on one rank; see
            :mod:`tslightning.distributed.rank_assignment`). ``None``: every index ``0 <= i < m``. A GRPO group is
            split only under sharded statistics, whose exchange gives every rank all m rewards (the learner refuses
            a split GRPO group otherwise); ``group_sizes`` keeps the global m either way.
    """

    objective: Objective
    policy_version: int
    group_sizes: Mapping[str, int]
    global_num_prompts: int | None = None
    trajectories: Mapping[str, tuple[int, ...]] | None = None
    oldest_policy_version: int | None = None
    """``fully_async`` only: sources may carry any version in [oldest, policy_version] (trajectories that started
    before a publication finish under the new weights). ``None``: every source carries ``policy_version``."""

    def __post_init__(self) -> None:
        if not isinstance(self.objective, Objective):  # BatchPlan("grpo", ...) too
            if self.objective not in tuple(Objective):
                raise SourceError(
                    f"BatchPlan.objective must be one of {[o.value for o in Objective]} (or an Objective); "
                    f"got {self.objective!r}"
                )
            object.__setattr__(self, "objective", Objective(self.objective))
        if not self.group_sizes and self.global_num_prompts is None:
            raise SourceError("BatchPlan.group_sizes is empty; register every group of the logical batch")
        check_int("BatchPlan", "policy_version", self.policy_version)
        bad = {g: m for g, m in self.group_sizes.items() if not isinstance(m, int) or isinstance(m, bool) or m < 1}
        if bad:
            raise SourceError(f"BatchPlan.group_sizes must map each group id to an int >= 1; bad entries: {bad}")
        if self.global_num_prompts is not None:
            check_int("BatchPlan", "global_num_prompts", self.global_num_prompts, minimum=1)
        if self.oldest_policy_version is not None:
            check_int("BatchPlan", "oldest_policy_version", self.oldest_policy_version)
            if self.oldest_policy_version > self.policy_version:
                raise SourceError("BatchPlan.oldest_policy_version must not exceed policy_version")
        if self.global_num_prompts is not None and self.global_num_prompts < len(self.group_sizes):
            raise SourceError(
                f"BatchPlan.global_num_prompts={self.global_num_prompts} is below this rank's {len(self.group_sizes)} "
                "groups; pass the prompt count of the whole logical batch (or None on one rank)"
            )
        if self.trajectories is not None:
            self._check_trajectories()

    def _check_trajectories(self) -> None:
        if set(self.trajectories) != set(self.group_sizes):
            raise SourceError(
                f"BatchPlan.trajectories names groups {sorted(self.trajectories)} but group_sizes registers "
                f"{sorted(self.group_sizes)}; give this rank's trajectory indices for exactly its groups"
            )
        bad = {
            g: indices
            for g, indices in self.trajectories.items()
            if not indices
            or len(set(indices)) != len(indices)
            or not all(0 <= i < self.group_sizes[g] for i in indices)
        }
        if bad:
            raise SourceError(
                f"BatchPlan.trajectories must give distinct indices 0 <= i < m, at least one per group; bad: {bad}"
            )

    def trajectory_indices(self, group_id: str) -> frozenset[int]:
        """The trajectory indices of ``group_id`` this rank serves."""
        if self.trajectories is None:
            return frozenset(range(self.group_sizes[group_id]))
        return frozenset(self.trajectories[group_id])

    @property
    def num_prompts(self) -> int:
        """P, the number of prompts (groups) in the whole logical batch."""
        return self.global_num_prompts or len(self.group_sizes)

    @property
    def allowed_versions(self) -> range:
        """Policy versions a source of this batch may carry."""
        oldest = self.policy_version if self.oldest_policy_version is None else self.oldest_policy_version
        return range(oldest, self.policy_version + 1)

    @property
    def num_trajectories(self) -> int:
        """Trajectories this rank serves."""
        return sum(len(self.trajectory_indices(g)) for g in self.group_sizes)


@dataclass
class _GroupState:
    size: int
    indices: frozenset[int]  # the trajectory indices served on this rank
    finished: set[int] = field(default_factory=set)  # GRPO: trajectories in; OPD: trajectories closed
    turns: dict[int, set[int]] = field(default_factory=dict)  # OPD: trajectory -> turn indices received
    closed: bool = False


class BatchRegistry:
    """Completion state machine of one logical batch; every error names the record and the fix."""

    def __init__(self, plan: BatchPlan) -> None:
        self.plan = plan
        self._groups = {gid: _GroupState(size, plan.trajectory_indices(gid)) for gid, size in plan.group_sizes.items()}
        self.batch_closed = False

    def check(self, item: StreamItem) -> None:
        """Raise :class:`SourceError` if ``item`` cannot be accepted now; never mutates."""
        if self.batch_closed:
            raise SourceError(f"{type(item).__name__} arrived after BatchClosed for version {self.plan.policy_version}")
        if isinstance(item, BatchClosed):
            self._check_batch_closed(item)
            return
        group = self._open_group(type(item).__name__, item.group_id)
        if isinstance(item, TrajectorySource):
            self._check_trajectory_source(item, group)
        elif isinstance(item, TurnSource):
            self._check_turn_source(item, group)
        elif isinstance(item, TrajectoryClosed):
            self._check_trajectory_closed(item, group)
        elif isinstance(item, GroupClosed):
            self._check_group_closed(item, group)
        else:
            raise SourceError(f"unknown stream item {type(item).__name__}; expected a source or completion event")

    def record(self, item: StreamItem) -> None:
        """Record an item that passed :meth:`check`."""
        if isinstance(item, BatchClosed):
            self.batch_closed = True
            return
        group = self._groups[item.group_id]
        if isinstance(item, TrajectorySource):
            group.finished.add(item.trajectory_index)
        elif isinstance(item, TurnSource):
            group.turns.setdefault(item.trajectory_index, set()).add(item.turn_index)
        elif isinstance(item, TrajectoryClosed):
            group.finished.add(item.trajectory_index)
        elif isinstance(item, GroupClosed):
            group.closed = True

    @property
    def open_groups(self) -> list[str]:
        return [gid for gid, g in self._groups.items() if not g.closed]

    def require_complete(self) -> None:
        """Raise unless every registered group is closed and BatchClosed arrived (the barrier's precondition)."""
        problems = []
        if self.open_groups:
            shown = ", ".join(self.open_groups[:8]) + (" ..." if len(self.open_groups) > 8 else "")
            problems.append(f"{len(self.open_groups)} registered group(s) still open ({shown})")
        if not self.batch_closed:
            problems.append("BatchClosed has not arrived")
        if problems:
            raise SourceError(
                f"barrier for version {self.plan.policy_version} reached with "
                + " and ".join(problems)
                + "; wait for every trajectory, group and the batch to close before the optimizer step"
            )

    def _open_group(self, kind: str, group_id: str) -> _GroupState:
        group = self._groups.get(group_id)
        if group is None:
            raise SourceError(f"{kind} for unknown group {group_id!r}; register it in BatchPlan.group_sizes")
        if group.closed:
            raise SourceError(f"{kind} for group {group_id!r}, which is already closed")
        return group

    def _check_source_common(self, item: TrajectorySource | TurnSource, group: _GroupState, objective: Objective):
        kind = type(item).__name__
        if self.plan.objective is not objective:
            raise SourceError(f"{kind} in a {self.plan.objective.value} batch; the objective is fixed by BatchPlan")
        if item.policy_version not in self.plan.allowed_versions:
            raise PolicyVersionError(
                f"{kind}.policy_version is {item.policy_version} but logical batch B_{self.plan.policy_version} is "
                f"sampled by θ_{self.plan.policy_version}; a batch never mixes sources of another policy version"
            )
        if item.trajectory_index >= group.size:
            raise SourceError(
                f"{kind}.trajectory_index {item.trajectory_index} is outside group {item.group_id!r} "
                f"of size {group.size}"
            )
        if item.trajectory_index not in group.indices:
            raise SourceError(
                f"{kind} ({item.group_id!r}, {item.trajectory_index}) belongs to another learner rank; this rank's "
                f"BatchPlan.trajectories holds {sorted(group.indices)} of that group"
            )

    def _check_trajectory_source(self, item: TrajectorySource, group: _GroupState) -> None:
        self._check_source_common(item, group, Objective.GRPO)
        if item.trajectory_index in group.finished:
            raise SourceError(
                f"TrajectorySource ({item.group_id!r}, {item.trajectory_index}) arrived twice; "
                "each trajectory is one source"
            )

    def _check_turn_source(self, item: TurnSource, group: _GroupState) -> None:
        self._check_source_common(item, group, Objective.OPD)
        if item.trajectory_index in group.finished:
            raise SourceError(f"TurnSource for trajectory ({item.group_id!r}, {item.trajectory_index}), already closed")
        if item.turn_index in group.turns.get(item.trajectory_index, ()):
            raise SourceError(
                f"TurnSource ({item.group_id!r}, {item.trajectory_index}, turn {item.turn_index}) arrived twice"
            )

    def _check_trajectory_closed(self, item: TrajectoryClosed, group: _GroupState) -> None:
        if self.plan.objective is not Objective.OPD:
            raise SourceError("TrajectoryClosed in a GRPO batch; a GRPO trajectory closes with its TrajectorySource")
        if item.trajectory_index not in group.indices:
            raise SourceError(
                f"TrajectoryClosed.trajectory_index {item.trajectory_index} is not served here: group "
                f"{item.group_id!r} has {group.size} trajectories, this rank holds {sorted(group.indices)}"
            )
        if item.trajectory_index in group.finished:
            raise SourceError(f"trajectory ({item.group_id!r}, {item.trajectory_index}) closed twice")
        received = group.turns.get(item.trajectory_index, set())
        expected = set(range(item.num_turn_sources))
        if received != expected:
            missing, extra = sorted(expected - received), sorted(received - expected)
            raise SourceError(
                f"TrajectoryClosed ({item.group_id!r}, {item.trajectory_index}) says {item.num_turn_sources} turn "
                f"sources, but turns missing={missing} unexpected={extra}; close the trajectory after its last turn"
            )

    def _check_group_closed(self, item: GroupClosed, group: _GroupState) -> None:
        missing = sorted(group.indices - group.finished)
        if missing:
            what = "rewards" if self.plan.objective is Objective.GRPO else "closed trajectories"
            raise SourceError(
                f"GroupClosed {item.group_id!r} with {what} missing for trajectory indices {missing}; "
                "close a group only after all of its trajectories finish"
            )

    def _check_batch_closed(self, item: BatchClosed) -> None:
        if item.policy_version not in self.plan.allowed_versions:
            raise PolicyVersionError(
                f"BatchClosed.policy_version is {item.policy_version}, expected {self.plan.policy_version}"
            )
        if self.open_groups:
            raise SourceError(f"BatchClosed while groups are open: {self.open_groups[:8]}; close every group first")
