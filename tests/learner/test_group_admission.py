"""Group admission cap (App. D.3) and the streaming GRPO group accumulator (Eq. 7)."""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tslightning.core.group_accumulator import GroupAccumulator
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.learner.group_admission import GroupAdmission
from tslightning.objectives.advantages import AdvantageEstimator

CLOSE = "close"


# ============================================================================= GroupAdmission
@pytest.mark.parametrize("cap", [0, -1, 1.5, "2", 2.0])
def test_invalid_cap(cap):
    with pytest.raises(ValueError, match="group_admission_cap"):
        GroupAdmission(cap)


@pytest.mark.parametrize("cap", [None, 1, 3])
def test_valid_cap(cap):
    assert GroupAdmission(cap).cap == cap


def test_no_cap_admits_everything_immediately():
    adm: GroupAdmission[int] = GroupAdmission(None)
    for j in range(50):
        assert adm.offer(f"g{j}", j) == [j]
    assert len(adm.open) == 50
    assert adm.num_waiting == 0
    assert adm.release("g3") == []
    assert "g3" not in adm.open


def test_cap_one_example():
    adm: GroupAdmission[str] = GroupAdmission(1)
    assert adm.offer("a", "a0") == ["a0"]
    assert adm.offer("b", "b0") == []
    assert adm.offer("a", "a1") == ["a1"]  # an open group is always admitted
    assert adm.offer("c", "c0") == []
    assert adm.offer("b", "b1") == []
    assert adm.num_waiting == 3
    assert adm.open == {"a"}
    assert adm.release("a") == ["b0", "b1"]  # oldest waiting group first, in its own order
    assert adm.open == {"b"} and adm.num_waiting == 1
    assert adm.offer("c", "c1") == []  # still behind the cap
    assert adm.release("b") == ["c0", "c1"]
    assert adm.release("c") == []
    assert adm.open == set() and adm.num_waiting == 0


def test_release_admits_several_groups_up_to_cap():
    adm: GroupAdmission[str] = GroupAdmission(2)
    assert adm.offer("a", "a0") == ["a0"]
    assert adm.offer("b", "b0") == ["b0"]
    for g in "cde":
        assert adm.offer(g, f"{g}0") == []
    assert adm.release("a") == ["c0"]
    assert adm.open == {"b", "c"}
    assert adm.release("b") == ["d0"]
    assert adm.open == {"c", "d"}
    assert adm.release("c") == ["e0"]
    assert adm.open == {"d", "e"}
    assert adm.release("d") == [] and adm.release("e") == []
    assert adm.open == set() and adm.num_waiting == 0


def test_new_group_waits_behind_earlier_waiting_groups():
    adm: GroupAdmission[str] = GroupAdmission(1)
    adm.offer("a", "a0")
    adm.offer("b", "b0")
    assert adm.release("a") == ["b0"]
    # b open, nothing waiting: a new group waits because the cap is reached
    assert adm.offer("c", "c0") == []


def test_reset_clears_everything():
    adm: GroupAdmission[str] = GroupAdmission(1)
    adm.offer("a", "a0")
    adm.offer("b", "b0")
    adm.reset()
    assert adm.open == set() and adm.num_waiting == 0
    assert adm.offer("b", "b1") == ["b1"]


@st.composite
def offer_sequences(draw):
    """Each group's items in order, ending with a close marker; groups randomly interleaved."""
    n_groups = draw(st.integers(1, 7))
    lengths = [draw(st.integers(0, 4)) for _ in range(n_groups)]
    labels = [g for g, n in enumerate(lengths) for _ in range(n + 1)]
    order = draw(st.permutations(labels))
    cursor = [0] * n_groups
    offers = []
    for g in order:
        k = cursor[g]
        cursor[g] += 1
        offers.append((f"g{g}", (f"g{g}", CLOSE if k == lengths[g] else k)))
    return offers


@settings(max_examples=300, deadline=None)
@given(offers=offer_sequences(), cap=st.sampled_from([None, 1, 2, 3]))
def test_cap_is_respected_over_random_interleavings(offers, cap):
    adm: GroupAdmission[tuple[str, object]] = GroupAdmission(cap)
    processed: list[tuple[str, object]] = []
    active: set[str] = set()  # groups the consumer has started and not yet closed
    first_offer_order: list[str] = []
    start_order: list[str] = []
    max_active = 0
    for group, item in offers:
        if group not in first_offer_order:
            first_offer_order.append(group)
        admitted = adm.offer(group, item)
        if cap is None:
            assert admitted == [item]
        elif admitted == []:
            assert len(adm.open) == cap  # an item waits only when the cap is reached
        else:
            assert admitted == [item]
        work = deque(admitted)
        while work:
            g, x = work.popleft()
            processed.append((g, x))
            if g not in active:
                active.add(g)
                start_order.append(g)
            max_active = max(max_active, len(active))
            if cap is not None:
                assert len(active) <= cap
                assert len(adm.open) <= cap
            if x == CLOSE:
                active.discard(g)
                work.extend(adm.release(g))
    # nothing left waiting, nothing left open: no deadlock
    assert adm.num_waiting == 0
    assert adm.open == set()
    assert active == set()
    # every item processed exactly once, per-group order preserved
    assert sorted(processed, key=repr) == sorted((item for _, item in offers), key=repr)
    assert len(processed) == len(offers)
    for group in first_offer_order:
        offered = [item for g, item in offers if g == group]
        assert [p for p in processed if p[0] == group] == offered
    # groups are started in the order they first became ready (arrival order)
    assert start_order == first_offer_order
    if cap is None:
        # without a cap nothing is ever deferred: processing order equals offer order
        assert processed == [item for _, item in offers]
    else:
        assert max_active <= cap


# ============================================================================= GroupAccumulator
def make_layout(dtype: torch.dtype = torch.float64) -> ParameterLayout:
    params = [
        torch.nn.Parameter(torch.zeros(3, 2, dtype=dtype)),
        torch.nn.Parameter(torch.zeros(5, dtype=dtype), requires_grad=False),  # not trained: excluded
        torch.nn.Parameter(torch.zeros(4, dtype=dtype)),
    ]
    return ParameterLayout(params)


def random_grads(gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(3, 2, generator=gen, dtype=torch.float64), torch.randn(4, generator=gen, dtype=torch.float64)]


def flat(grads: list[torch.Tensor]) -> list[Fraction]:
    return [Fraction(v) for g in grads for v in g.reshape(-1).tolist()]


def explicit_scale(rewards: list[float], estimator: AdvantageEstimator, eps: float = 1e-6) -> float:
    m = len(rewards)
    if estimator is AdvantageEstimator.GRPO:
        return 1.0 / (statistics.pstdev(rewards) + eps)
    if estimator is AdvantageEstimator.GRPO_SAMPLE:
        return 1.0 / (statistics.stdev(rewards) + eps)
    if estimator is AdvantageEstimator.DR_GRPO:
        return 1.0
    return m / (m - 1)


def explicit_direction(groups: dict[str, list[tuple[float, list[torch.Tensor]]]], estimator) -> torch.Tensor:
    """Σ_G (a_G/m)(Σ r_i H_i − μ Σ H_i), evaluated exactly in rationals (a_G rounded once to float64)."""
    total = [Fraction(0)] * 10
    for members in groups.values():
        rewards = [r for r, _ in members]
        m = len(rewards)
        if len(set(rewards)) == 1:
            continue
        mu = sum(Fraction(r) for r in rewards) / m
        a = Fraction(explicit_scale(rewards, estimator))
        g1 = [Fraction(0)] * 10
        g2 = [Fraction(0)] * 10
        for r, grads in members:
            h = flat(grads)
            g1 = [x + Fraction(r) * y for x, y in zip(g1, h, strict=True)]
            g2 = [x + y for x, y in zip(g2, h, strict=True)]
        total = [t + a / m * (x - mu * y) for t, x, y in zip(total, g1, g2, strict=True)]
    return torch.tensor([float(t) for t in total], dtype=torch.float64)


def advantage_form(groups: dict[str, list[tuple[float, list[torch.Tensor]]]], estimator) -> torch.Tensor:
    """The same direction in batch form, (1/m) Σ_i A_i H_i with A_i from each estimator's own definition."""
    total = torch.zeros(10, dtype=torch.float64)
    for members in groups.values():
        rewards = [r for r, _ in members]
        m = len(rewards)
        if len(set(rewards)) == 1:
            continue
        mu = math.fsum(rewards) / m
        for i, (r, grads) in enumerate(members):
            if estimator is AdvantageEstimator.RLOO:
                adv = r - math.fsum(rewards[:i] + rewards[i + 1 :]) / (m - 1)
            elif estimator is AdvantageEstimator.DR_GRPO:
                adv = r - mu
            else:
                adv = (r - mu) * explicit_scale(rewards, estimator)
            total += adv / m * torch.cat([g.reshape(-1) for g in grads])
    return total


@pytest.mark.parametrize("estimator", list(AdvantageEstimator))
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("offset", [0.0, 1000.0])
def test_accumulator_matches_explicit_group_direction(estimator, seed, offset):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    layout = make_layout()
    assert layout.numel == 10
    acc = GroupAccumulator(layout, estimator, dtype=torch.float64)
    sizes = {"a": 4, "b": 3, "c": 2}
    groups = {
        g: [(offset + rng.choice([0.0, 1.0, 0.5, rng.uniform(-2, 3)]), random_grads(gen)) for _ in range(m)]
        for g, m in sizes.items()
    }
    groups["b"][0] = (offset + 7.0, groups["b"][0][1])  # guarantee non-uniform groups
    groups["c"][1] = (offset - 1.0, groups["c"][1][1])
    schedule = [g for g, m in sizes.items() for _ in range(m)]
    rng.shuffle(schedule)
    cursor = dict.fromkeys(sizes, 0)
    reductions = {}
    for g in schedule:
        r, grads = groups[g][cursor[g]]
        acc.add(g, sizes[g], r, grads)
        cursor[g] += 1
        if cursor[g] == sizes[g]:
            reductions[g] = acc.close(g)
    assert acc.open_groups == []
    expected = explicit_direction(groups, estimator)
    assert acc.batch.dtype == torch.float64 and acc.batch.shape == (10,)
    torch.testing.assert_close(acc.batch, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(acc.batch, advantage_form(groups, estimator), rtol=0, atol=1e-9)
    for g, red in reductions.items():
        rewards = [r for r, _ in groups[g]]
        assert red.group_id == g and red.rewards == tuple(rewards)
        assert red.mean == pytest.approx(float(sum(Fraction(r) for r in rewards) / len(rewards)), rel=1e-15)
        assert red.uniform == (len(set(rewards)) == 1)
        if not red.uniform:
            assert red.scale == pytest.approx(explicit_scale(rewards, estimator), rel=1e-12)


def test_accumulator_is_linear_in_each_group():
    """Closing two groups in either order gives the sum of closing each alone."""
    gen = torch.Generator().manual_seed(11)
    data = {
        g: [(float(r), random_grads(gen)) for r in rewards] for g, rewards in {"x": [0, 1, 3], "y": [2, 2, 5]}.items()
    }

    def run(order):
        acc = GroupAccumulator(make_layout(), dtype=torch.float64)
        for g in order:
            for r, grads in data[g]:
                acc.add(g, 3, r, grads)
            acc.close(g)
        return acc.batch

    torch.testing.assert_close(run("xy"), run("x") + run("y"), rtol=0, atol=1e-13)
    torch.testing.assert_close(run("yx"), run("xy"), rtol=0, atol=1e-13)


@pytest.mark.parametrize("estimator", list(AdvantageEstimator))
def test_uniform_group_adds_exactly_zero(estimator):
    gen = torch.Generator().manual_seed(3)
    acc = GroupAccumulator(make_layout(), estimator, dtype=torch.float64)
    for _ in range(3):
        acc.add("u", 3, 0.1, random_grads(gen))
    red = acc.close("u")
    assert red.uniform and red.scale == 0.0 and red.rewards == (0.1, 0.1, 0.1)
    assert torch.equal(acc.batch, torch.zeros(10, dtype=torch.float64))
    # after a real group, a uniform group leaves the batch bit-identical
    for r in (0.0, 1.0):
        acc.add("v", 2, r, random_grads(gen))
    acc.close("v")
    before = acc.batch.clone()
    assert not torch.equal(before, torch.zeros(10, dtype=torch.float64))
    for _ in range(4):
        acc.add("w", 4, -0.3, random_grads(gen))
    assert acc.close("w").uniform
    assert torch.equal(acc.batch, before)


def test_uniform_group_exactly_zero_in_float32():
    gen = torch.Generator().manual_seed(4)
    acc = GroupAccumulator(make_layout(), AdvantageEstimator.GRPO)
    assert acc.batch.dtype == torch.float32
    for _ in range(3):
        acc.add("u", 3, 0.7, random_grads(gen))
    acc.close("u")
    assert torch.equal(acc.batch, torch.zeros(10, dtype=torch.float32))


def test_float32_accumulator_close_to_float64():
    gen = torch.Generator().manual_seed(5)
    members = [(r, random_grads(gen)) for r in (0.0, 1.0, 1.0, 0.25)]
    acc = GroupAccumulator(make_layout(), AdvantageEstimator.GRPO, dtype=torch.float32)
    for r, grads in members:
        acc.add("g", 4, r, grads)
    acc.close("g")
    expected = explicit_direction({"g": members}, AdvantageEstimator.GRPO)
    torch.testing.assert_close(acc.batch.double(), expected, rtol=0, atol=1e-5)


def test_held_numel_tracks_open_groups():
    gen = torch.Generator().manual_seed(6)
    layout = make_layout()
    n = layout.numel
    acc = GroupAccumulator(layout, dtype=torch.float64)
    assert acc.held_numel == n and acc.peak_held_numel == n

    def check(open_groups: int, peak_open: int) -> None:
        assert len(acc.open_groups) == open_groups
        assert acc.held_numel == n * (1 + 2 * open_groups)
        assert acc.peak_held_numel == n * (1 + 2 * peak_open)

    acc.add("a", 2, 0.0, random_grads(gen))
    check(1, 1)
    acc.add("b", 3, 1.0, random_grads(gen))
    check(2, 2)
    acc.add("a", 2, 1.0, random_grads(gen))
    check(2, 2)
    acc.add("c", 1, 1.0, random_grads(gen))
    check(3, 3)
    acc.close("a")
    check(2, 3)
    acc.close("c")
    check(1, 3)
    with pytest.raises(RuntimeError, match="'b'"):
        acc.close("b")  # only 1 of 3 sources folded in
    check(1, 3)
    acc.add("b", 3, 2.0, random_grads(gen))
    acc.add("b", 3, 0.0, random_grads(gen))
    acc.close("b")
    check(0, 3)
    assert acc.open_groups == []


def test_incomplete_close_keeps_statistics():
    gen = torch.Generator().manual_seed(7)
    members = [(r, random_grads(gen)) for r in (0.0, 2.0, 5.0)]
    acc = GroupAccumulator(make_layout(), AdvantageEstimator.DR_GRPO, dtype=torch.float64)
    acc.add("g", 3, *members[0])
    acc.add("g", 3, *members[1])
    with pytest.raises(RuntimeError):
        acc.close("g")
    assert torch.equal(acc.batch, torch.zeros(10, dtype=torch.float64))
    acc.add("g", 3, *members[2])
    acc.close("g")
    torch.testing.assert_close(
        acc.batch, explicit_direction({"g": members}, AdvantageEstimator.DR_GRPO), rtol=0, atol=1e-12
    )


def test_reset_zeroes():
    gen = torch.Generator().manual_seed(8)
    layout = make_layout()
    acc = GroupAccumulator(layout, dtype=torch.float64)
    for r in (0.0, 1.0):
        acc.add("a", 2, r, random_grads(gen))
    acc.close("a")
    acc.add("b", 2, 3.0, random_grads(gen))
    assert acc.peak_held_numel == 3 * layout.numel
    assert not torch.equal(acc.batch, torch.zeros(10, dtype=torch.float64))
    acc.reset()
    assert torch.equal(acc.batch, torch.zeros(10, dtype=torch.float64))
    assert acc.open_groups == []
    assert acc.held_numel == layout.numel and acc.peak_held_numel == layout.numel
    # the dropped group "b" starts fresh
    members = [(r, random_grads(gen)) for r in (1.0, 4.0)]
    for r, grads in members:
        acc.add("b", 2, r, grads)
    acc.close("b")
    torch.testing.assert_close(
        acc.batch, explicit_direction({"b": members}, AdvantageEstimator.GRPO), rtol=0, atol=1e-12
    )


def test_layout_excludes_frozen_parameters_and_orders_slices():
    layout = make_layout()
    assert layout.numel == 10 and len(layout.parameters) == 2
    flat_vec = layout.zeros(torch.float64)
    grads = [torch.arange(6, dtype=torch.float64).reshape(3, 2), 10 + torch.arange(4, dtype=torch.float64)]
    layout.add_(flat_vec, grads, alpha=2.0)
    assert flat_vec.tolist() == [2.0 * v for v in [0, 1, 2, 3, 4, 5, 10, 11, 12, 13]]
    with pytest.raises(ValueError):
        layout.add_(flat_vec, grads[:1])
