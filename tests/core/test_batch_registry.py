"""BatchRegistry: the completion state machine of one logical batch (Algorithm 1, lines 3, 12 and 24)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from tslightning.core.batch_registry import BatchPlan, BatchRegistry, Objective
from tslightning.core.sources import (
    BatchClosed,
    GroupClosed,
    PolicyVersionError,
    SourceError,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)

K = 2  # the learner's policy version in these tests


def traj(group: str, index: int, version: int = K, reward: float = 1.0) -> TrajectorySource:
    return TrajectorySource(
        group_id=group,
        trajectory_index=index,
        token_ids=torch.tensor([1, 2, 3]),
        scored_mask=torch.tensor([False, False, True]),
        reward=reward,
        policy_version=version,
        prompt_length=1,
    )


def turn(group: str, index: int, turn_index: int, version: int = K) -> TurnSource:
    return TurnSource(
        group_id=group,
        trajectory_index=index,
        turn_index=turn_index,
        token_ids=torch.tensor([1, 2, 3]),
        scored_mask=torch.tensor([False, True, True]),
        teacher_logprobs=torch.tensor([-0.5, -1.5]),
        policy_version=version,
    )


def registry(objective: Objective, sizes: dict[str, int], version: int = K) -> BatchRegistry:
    return BatchRegistry(BatchPlan(objective, version, dict(sizes)))


def feed(reg: BatchRegistry, *items) -> None:
    for item in items:
        reg.check(item)
        reg.record(item)


def rejected(reg: BatchRegistry, item, *fragments: str, error: type[SourceError] = SourceError) -> SourceError:
    with pytest.raises(error) as info:
        reg.check(item)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"
    return info.value


def outcome(reg: BatchRegistry, item) -> tuple[type, str] | None:
    try:
        reg.check(item)
    except SourceError as exc:
        return type(exc), str(exc)
    return None


# ============================================================================= BatchPlan
def test_plan_num_prompts_and_trajectories():
    plan = BatchPlan(Objective.GRPO, 0, {"a": 4, "b": 2, "c": 1})
    assert plan.num_prompts == 3
    assert plan.num_trajectories == 7
    assert BatchPlan(Objective.GRPO, 0, {"a": 4, "b": 2}, global_num_prompts=10).num_prompts == 10
    assert BatchPlan(Objective.OPD, 0, {"a": 4, "b": 2}, global_num_prompts=2).num_prompts == 2


def test_plan_objective_from_string():
    assert Objective("grpo") is Objective.GRPO and Objective("opd") is Objective.OPD


def test_plan_empty_group_sizes():
    with pytest.raises(SourceError, match="group_sizes"):
        BatchPlan(Objective.GRPO, 0, {})


@pytest.mark.parametrize("bad", [0, -1, 2.0, "3", None])
def test_plan_bad_group_size(bad):
    with pytest.raises(SourceError, match="group_sizes") as info:
        BatchPlan(Objective.GRPO, 0, {"ok": 2, "bad_group": bad})
    assert "bad_group" in str(info.value)
    assert "'ok'" not in str(info.value)


@pytest.mark.parametrize("prompts", [0, 1, 2, -5])
def test_plan_global_num_prompts_below_groups(prompts):
    with pytest.raises(SourceError, match="global_num_prompts"):
        BatchPlan(Objective.GRPO, 0, {"a": 2, "b": 2, "c": 2}, global_num_prompts=prompts)


# ============================================================================= happy paths
def test_grpo_happy_path():
    reg = registry(Objective.GRPO, {"a": 3, "b": 2})
    assert reg.open_groups == ["a", "b"] and not reg.batch_closed
    feed(reg, traj("a", 2), traj("b", 0), traj("a", 0), traj("b", 1))
    assert reg.open_groups == ["a", "b"]
    feed(reg, GroupClosed("b"))
    assert reg.open_groups == ["a"]
    with pytest.raises(SourceError):
        reg.require_complete()
    feed(reg, traj("a", 1), GroupClosed("a"))
    assert reg.open_groups == []
    with pytest.raises(SourceError, match="BatchClosed has not arrived"):
        reg.require_complete()
    feed(reg, BatchClosed(K))
    assert reg.batch_closed
    reg.require_complete()


def test_opd_happy_path():
    reg = registry(Objective.OPD, {"a": 2, "b": 1})
    feed(reg, turn("a", 0, 0), turn("b", 0, 0), turn("a", 1, 0), turn("a", 0, 1))
    feed(reg, TrajectoryClosed("a", 0, num_turn_sources=2))
    feed(reg, turn("b", 0, 1), turn("b", 0, 2), TrajectoryClosed("b", 0, 3), GroupClosed("b"))
    assert reg.open_groups == ["a"]
    feed(reg, turn("a", 1, 1), TrajectoryClosed("a", 1, 2), GroupClosed("a"))
    assert reg.open_groups == []
    feed(reg, BatchClosed(K))
    reg.require_complete()


def test_opd_turns_may_arrive_out_of_order():
    reg = registry(Objective.OPD, {"a": 1})
    feed(reg, turn("a", 0, 2), turn("a", 0, 0), turn("a", 0, 1), TrajectoryClosed("a", 0, 3), GroupClosed("a"))
    feed(reg, BatchClosed(K))
    reg.require_complete()


def _interleave(data, streams: list[list]) -> list:
    labels = [i for i, s in enumerate(streams) for _ in s]
    order = data.draw(st.permutations(labels))
    cursors = [0] * len(streams)
    out = []
    for label in order:
        out.append(streams[label][cursors[label]])
        cursors[label] += 1
    return out


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4), data=st.data())
def test_grpo_any_valid_interleaving_completes(sizes, data):
    groups = {f"g{j}": m for j, m in enumerate(sizes)}
    streams = []
    for gid, m in groups.items():
        order = data.draw(st.permutations(range(m)))
        streams.append([traj(gid, i) for i in order] + [GroupClosed(gid)])
    reg = registry(Objective.GRPO, groups)
    closed = []
    for item in _interleave(data, streams):
        feed(reg, item)
        if isinstance(item, GroupClosed):
            closed.append(item.group_id)
        assert reg.open_groups == [g for g in groups if g not in closed]
    assert not reg.batch_closed
    feed(reg, BatchClosed(K))
    reg.require_complete()


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3), data=st.data())
def test_opd_any_valid_interleaving_completes(sizes, data):
    groups = {f"g{j}": m for j, m in enumerate(sizes)}
    streams = []
    for gid, m in groups.items():
        per_trajectory = []
        for i in range(m):
            n = data.draw(st.integers(1, 3))
            turns = data.draw(st.permutations(range(n)))
            per_trajectory.append([turn(gid, i, t) for t in turns] + [TrajectoryClosed(gid, i, n)])
        streams.append(_interleave(data, per_trajectory) + [GroupClosed(gid)])
    reg = registry(Objective.OPD, groups)
    for item in _interleave(data, streams):
        feed(reg, item)
    assert reg.open_groups == []
    feed(reg, BatchClosed(K))
    reg.require_complete()


# ============================================================================= errors
@pytest.mark.parametrize("objective", list(Objective))
def test_unknown_group(objective):
    reg = registry(objective, {"a": 2})
    item = traj("nope", 0) if objective is Objective.GRPO else turn("nope", 0, 0)
    rejected(reg, item, "unknown group", "'nope'")
    rejected(reg, GroupClosed("nope"), "unknown group", "'nope'")
    if objective is Objective.OPD:
        rejected(reg, TrajectoryClosed("nope", 0, 1), "unknown group", "'nope'")


def test_grpo_source_for_closed_group():
    reg = registry(Objective.GRPO, {"a": 1, "b": 1})
    feed(reg, traj("a", 0), GroupClosed("a"))
    rejected(reg, traj("a", 0), "'a'", "already closed")


def test_opd_source_for_closed_group():
    reg = registry(Objective.OPD, {"a": 1})
    feed(reg, turn("a", 0, 0), TrajectoryClosed("a", 0, 1), GroupClosed("a"))
    rejected(reg, turn("a", 0, 1), "'a'", "already closed")
    rejected(reg, TrajectoryClosed("a", 0, 1), "'a'", "already closed")


@pytest.mark.parametrize("objective", list(Objective))
def test_group_closed_twice(objective):
    reg = registry(objective, {"a": 1, "b": 1})
    if objective is Objective.GRPO:
        feed(reg, traj("a", 0))
    else:
        feed(reg, turn("a", 0, 0), TrajectoryClosed("a", 0, 1))
    feed(reg, GroupClosed("a"))
    rejected(reg, GroupClosed("a"), "GroupClosed", "'a'", "already closed")


def test_grpo_group_closed_with_missing_trajectories():
    reg = registry(Objective.GRPO, {"a": 5})
    feed(reg, traj("a", 0), traj("a", 2), traj("a", 4))
    rejected(reg, GroupClosed("a"), "'a'", "[1, 3]", "rewards")
    rejected(registry(Objective.GRPO, {"a": 2}), GroupClosed("a"), "[0, 1]")


def test_opd_group_closed_with_unclosed_trajectories():
    reg = registry(Objective.OPD, {"a": 3})
    # trajectory 1 has all of its turns but no TrajectoryClosed; trajectory 2 has nothing
    feed(reg, turn("a", 0, 0), TrajectoryClosed("a", 0, 1), turn("a", 1, 0))
    rejected(reg, GroupClosed("a"), "'a'", "[1, 2]", "closed trajectories")


def test_duplicate_trajectory_source():
    reg = registry(Objective.GRPO, {"a": 2})
    feed(reg, traj("a", 1))
    rejected(reg, traj("a", 1, reward=0.0), "('a', 1)", "twice")


def test_duplicate_turn():
    reg = registry(Objective.OPD, {"a": 2})
    feed(reg, turn("a", 1, 0), turn("a", 1, 1))
    rejected(reg, turn("a", 1, 1), "('a', 1, turn 1)", "twice")
    feed(reg, turn("a", 0, 1))  # same turn index of another trajectory is fine


def test_turn_after_its_trajectory_closed():
    reg = registry(Objective.OPD, {"a": 2})
    feed(reg, turn("a", 0, 0), TrajectoryClosed("a", 0, 1))
    rejected(reg, turn("a", 0, 1), "('a', 0)", "already closed")
    feed(reg, turn("a", 1, 0))  # the other trajectory is still open


def test_trajectory_closed_twice():
    reg = registry(Objective.OPD, {"a": 2})
    feed(reg, turn("a", 0, 0), TrajectoryClosed("a", 0, 1))
    rejected(reg, TrajectoryClosed("a", 0, 1), "('a', 0)", "closed twice")


def test_trajectory_closed_with_missing_turn():
    reg = registry(Objective.OPD, {"a": 1})
    feed(reg, turn("a", 0, 0), turn("a", 0, 1))
    rejected(reg, TrajectoryClosed("a", 0, 3), "says 3", "missing=[2]", "unexpected=[]")


def test_trajectory_closed_with_gap():
    reg = registry(Objective.OPD, {"a": 1})
    feed(reg, turn("a", 0, 0), turn("a", 0, 2))
    rejected(reg, TrajectoryClosed("a", 0, 3), "missing=[1]")


def test_trajectory_closed_with_unexpected_turn():
    reg = registry(Objective.OPD, {"a": 1})
    feed(reg, turn("a", 0, 0), turn("a", 0, 1))
    rejected(reg, TrajectoryClosed("a", 0, 1), "missing=[]", "unexpected=[1]")
    with pytest.raises(SourceError, match="num_turn_sources"):
        TrajectoryClosed("a", 0, 0)
    feed(reg, TrajectoryClosed("a", 0, 2))


def test_trajectory_closed_negative_num_turn_sources_rejected():
    reg = registry(Objective.OPD, {"a": 1})
    with pytest.raises(SourceError, match="num_turn_sources"):
        TrajectoryClosed("a", 0, -1)
        reg.check(TrajectoryClosed("a", 0, -1))


@pytest.mark.parametrize("index", [2, 3, 10])
def test_trajectory_index_outside_group(index):
    rejected(registry(Objective.GRPO, {"a": 2}), traj("a", index), f"trajectory_index {index}", "size 2")
    rejected(registry(Objective.OPD, {"a": 2}), turn("a", index, 0), f"trajectory_index {index}", "size 2")
    rejected(registry(Objective.OPD, {"a": 2}), TrajectoryClosed("a", index, 1), f"trajectory_index {index}")


def test_trajectory_closed_negative_index():
    with pytest.raises(SourceError, match="trajectory_index"):
        TrajectoryClosed("a", -1, 1)


def test_wrong_objective_source_type():
    err = rejected(registry(Objective.OPD, {"a": 2}), traj("a", 0), "TrajectorySource", "opd")
    assert not isinstance(err, PolicyVersionError)
    err = rejected(registry(Objective.GRPO, {"a": 2}), turn("a", 0, 0), "TurnSource", "grpo")
    assert not isinstance(err, PolicyVersionError)
    rejected(registry(Objective.GRPO, {"a": 2}), TrajectoryClosed("a", 0, 1), "TrajectoryClosed", "GRPO")


def test_wrong_objective_checked_before_version():
    # a wrong-objective source with a wrong version is still reported as the objective problem
    err = rejected(registry(Objective.OPD, {"a": 2}), traj("a", 0, version=K + 1), "opd")
    assert not isinstance(err, PolicyVersionError)


@pytest.mark.parametrize("version", [K - 1, K + 1, 0])
def test_policy_version_error(version):
    rejected(
        registry(Objective.GRPO, {"a": 2}), traj("a", 0, version=version), f"is {version}", error=PolicyVersionError
    )
    rejected(
        registry(Objective.OPD, {"a": 2}), turn("a", 0, 0, version=version), f"is {version}", error=PolicyVersionError
    )
    reg = registry(Objective.GRPO, {"a": 1})
    feed(reg, traj("a", 0), GroupClosed("a"))
    rejected(reg, BatchClosed(version), "BatchClosed.policy_version", error=PolicyVersionError)
    feed(reg, BatchClosed(K))


@pytest.mark.parametrize("objective", list(Objective))
def test_batch_closed_while_groups_open(objective):
    reg = registry(objective, {"a": 1, "b": 1, "c": 1})
    if objective is Objective.GRPO:
        feed(reg, traj("b", 0), GroupClosed("b"))
    else:
        feed(reg, turn("b", 0, 0), TrajectoryClosed("b", 0, 1), GroupClosed("b"))
    err = rejected(reg, BatchClosed(K), "groups are open", "'a'", "'c'")
    assert "'b'" not in str(err)
    assert not reg.batch_closed


def test_anything_after_batch_closed():
    reg = registry(Objective.GRPO, {"a": 1})
    feed(reg, traj("a", 0), GroupClosed("a"), BatchClosed(K))
    for item in (traj("a", 0), GroupClosed("a"), BatchClosed(K), traj("zz", 0), turn("a", 0, 0)):
        rejected(reg, item, type(item).__name__, "after BatchClosed")
    reg.require_complete()


def test_anything_after_batch_closed_opd():
    reg = registry(Objective.OPD, {"a": 1})
    feed(reg, turn("a", 0, 0), TrajectoryClosed("a", 0, 1), GroupClosed("a"), BatchClosed(K))
    for item in (turn("a", 0, 1), TrajectoryClosed("a", 0, 1), GroupClosed("a"), BatchClosed(K)):
        rejected(reg, item, "after BatchClosed")


def test_unknown_item_type():
    with pytest.raises(SourceError, match="unknown stream item"):
        registry(Objective.GRPO, {"a": 1}).check(_Fake("a"))


class _Fake:
    def __init__(self, group_id: str) -> None:
        self.group_id = group_id


def test_require_complete_names_open_groups():
    reg = registry(Objective.GRPO, {"alpha": 1, "beta": 1, "gamma": 1}, version=7)
    feed(reg, traj("beta", 0, version=7), GroupClosed("beta"))
    with pytest.raises(SourceError) as info:
        reg.require_complete()
    msg = str(info.value)
    assert "2 registered group(s) still open" in msg
    assert "alpha" in msg and "gamma" in msg and "beta" not in msg
    assert "BatchClosed has not arrived" in msg
    assert "version 7" in msg


def test_require_complete_truncates_many_open_groups():
    reg = registry(Objective.GRPO, {f"group{j:02d}": 1 for j in range(12)})
    with pytest.raises(SourceError) as info:
        reg.require_complete()
    msg = str(info.value)
    assert "12 registered group(s) still open" in msg
    assert "group07" in msg and "group08" not in msg and "..." in msg


# ============================================================================= check never mutates
def test_rejected_items_leave_state_unchanged_grpo():
    sizes = {"a": 2, "b": 1}
    valid = [traj("a", 0), traj("b", 0), GroupClosed("b"), traj("a", 1), GroupClosed("a"), BatchClosed(K)]
    junk = [
        GroupClosed("a"),  # missing trajectory 1
        traj("a", 0),  # duplicate
        traj("a", 5),  # outside group
        traj("a", 1, version=K + 1),  # wrong version
        turn("a", 1, 0),  # wrong objective
        TrajectoryClosed("a", 1, 1),  # wrong objective
        BatchClosed(K),  # groups open
        traj("zz", 0),  # unknown group
    ]
    _check_junk_never_mutates(sizes, Objective.GRPO, valid, junk, insert_after=1)


def test_rejected_items_leave_state_unchanged_opd():
    sizes = {"a": 2}
    valid = [
        turn("a", 0, 0),
        turn("a", 1, 0),
        TrajectoryClosed("a", 0, 1),
        turn("a", 1, 1),
        TrajectoryClosed("a", 1, 2),
        GroupClosed("a"),
        BatchClosed(K),
    ]
    junk = [
        TrajectoryClosed("a", 1, 2),  # turn 1 missing; its check must not register anything
        TrajectoryClosed("a", 1, 3),  # turn 2 never arrived
        turn("a", 0, 1),  # trajectory 0 closed
        turn("a", 1, 0),  # duplicate
        turn("a", 1, 1, version=K - 1),  # wrong version
        GroupClosed("a"),
        traj("a", 1),
        BatchClosed(K),
    ]
    _check_junk_never_mutates(sizes, Objective.OPD, valid, junk, insert_after=3)


def _check_junk_never_mutates(sizes, objective, valid, junk, insert_after):
    reg = registry(objective, sizes)
    fresh = registry(objective, sizes)
    feed(reg, *valid[:insert_after])
    feed(fresh, *valid[:insert_after])
    probes = valid + junk
    for bad in junk:
        with pytest.raises(SourceError):
            reg.check(bad)
        for probe in probes:
            assert outcome(reg, probe) == outcome(fresh, probe), probe
        assert reg.open_groups == fresh.open_groups and reg.batch_closed == fresh.batch_closed
    feed(reg, *valid[insert_after:])
    reg.require_complete()


# ============================================================================= model-based fuzzing
class _Model:
    """Independent reference for which items a registry accepts (both objectives)."""

    def __init__(self, objective: Objective, sizes: dict[str, int]) -> None:
        self.objective = objective
        self.sizes = sizes
        self.received: dict[str, set[int]] = {g: set() for g in sizes}  # GRPO sources / OPD closed trajectories
        self.turns: dict[tuple[str, int], set[int]] = {}
        self.closed: set[str] = set()
        self.batch_closed = False

    def accepts(self, item) -> bool:
        if self.batch_closed:
            return False
        if isinstance(item, BatchClosed):
            return item.policy_version == K and self.closed == set(self.sizes)
        g = item.group_id
        if g not in self.sizes or g in self.closed:
            return False
        m = self.sizes[g]
        if isinstance(item, GroupClosed):
            return self.received[g] == set(range(m))
        if isinstance(item, TrajectorySource):
            return (
                self.objective is Objective.GRPO
                and item.policy_version == K
                and item.trajectory_index < m
                and item.trajectory_index not in self.received[g]
            )
        if isinstance(item, TurnSource):
            return (
                self.objective is Objective.OPD
                and item.policy_version == K
                and item.trajectory_index < m
                and item.trajectory_index not in self.received[g]
                and item.turn_index not in self.turns.get((g, item.trajectory_index), set())
            )
        assert isinstance(item, TrajectoryClosed)
        return (
            self.objective is Objective.OPD
            and 0 <= item.trajectory_index < m
            and item.trajectory_index not in self.received[g]
            and self.turns.get((g, item.trajectory_index), set()) == set(range(item.num_turn_sources))
        )

    def apply(self, item) -> None:
        if isinstance(item, BatchClosed):
            self.batch_closed = True
        elif isinstance(item, GroupClosed):
            self.closed.add(item.group_id)
        elif isinstance(item, TrajectorySource | TrajectoryClosed):
            self.received[item.group_id].add(item.trajectory_index)
        else:
            self.turns.setdefault((item.group_id, item.trajectory_index), set()).add(item.turn_index)

    @property
    def open_groups(self) -> list[str]:
        return [g for g in self.sizes if g not in self.closed]


SIZES = {"a": 2, "b": 1}
GRPO_UNIVERSE = (
    [traj(g, i, version=v) for g in ("a", "b", "zz") for i in range(3) for v in (K, K + 1)]
    + [GroupClosed(g) for g in ("a", "b", "zz")]
    + [BatchClosed(K), BatchClosed(K - 1), TrajectoryClosed("a", 0, 1), turn("a", 0, 0)]
)
OPD_UNIVERSE = (
    [turn(g, i, t, version=v) for g in ("a", "b") for i in range(3) for t in range(3) for v in (K, K + 1)]
    + [TrajectoryClosed(g, i, n) for g in ("a", "b", "zz") for i in (0, 1, 2) for n in range(1, 4)]
    + [GroupClosed(g) for g in ("a", "b", "zz")]
    + [BatchClosed(K), BatchClosed(K + 1), traj("a", 0), turn("zz", 0, 0)]
)


@pytest.mark.parametrize("objective", list(Objective))
@settings(max_examples=120, deadline=None)
@given(data=st.data())
def test_registry_matches_reference_model(objective, data):
    universe = GRPO_UNIVERSE if objective is Objective.GRPO else OPD_UNIVERSE
    reg = registry(objective, SIZES)
    shadow = registry(objective, SIZES)  # only ever sees accepted items
    model = _Model(objective, SIZES)
    for _ in range(data.draw(st.integers(0, 60))):
        # half the time pick an item the model accepts, so sequences get deep into the batch
        candidates = [u for u in universe if model.accepts(u)] if data.draw(st.booleans()) else []
        item = data.draw(st.sampled_from(candidates or universe))
        expected = model.accepts(item)
        got = outcome(reg, item)
        assert (got is None) == expected, (item, got)
        if expected:
            reg.record(item)
            shadow.check(item)
            shadow.record(item)
            model.apply(item)
        assert reg.open_groups == shadow.open_groups == model.open_groups
        assert reg.batch_closed == model.batch_closed
    for probe in universe:
        assert outcome(reg, probe) == outcome(shadow, probe), probe
    complete = model.batch_closed
    event(f"complete={complete}")
    if complete:
        reg.require_complete()
    else:
        with pytest.raises(SourceError):
            reg.require_complete()


def test_objective_given_as_a_string_is_stored_as_the_objective():
    plan = BatchPlan("opd", 0, {"a": 2})
    assert plan.objective is Objective.OPD
    BatchRegistry(plan).check(
        TurnSource("a", 0, 0, torch.tensor([1, 2]), torch.tensor([False, True]), torch.tensor([-1.0]), 0)
    )


@pytest.mark.parametrize("objective", ["ppo", 3, None])
def test_unknown_objective_names_the_choices(objective):
    with pytest.raises(SourceError, match=r"BatchPlan.objective must be one of \['grpo', 'opd'\].*got"):
        BatchPlan(objective, 0, {"a": 2})
