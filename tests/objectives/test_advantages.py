"""Group-relative advantages (Eqs. 5-7) checked against explicit formulas written out here.

Expected values are computed independently of :mod:`tslightning.objectives.advantages`: means with
``fractions.Fraction`` (exact), standard deviations with :mod:`statistics` (exactly rounded), and RLOO from its
leave-one-out definition.
"""

from __future__ import annotations

import math
import statistics
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tslightning.objectives.advantages import (
    GRPO_EPSILON,
    AdvantageEstimator,
    advantage_scale,
    group_advantages,
    group_mean,
    is_uniform,
)

EPS = 1e-6
ALL = list(AdvantageEstimator)


def exact_mean(rewards: list[float]) -> float:
    return float(sum(Fraction(r) for r in rewards) / len(rewards))


def expected_advantages(rewards: list[float], estimator: AdvantageEstimator, eps: float = EPS) -> list[float]:
    """The advantages as the paper / each estimator's own definition writes them (not via a_G)."""
    mu = exact_mean(rewards)
    if estimator is AdvantageEstimator.GRPO:
        sigma = statistics.pstdev(rewards)  # population std, Eq. 6
        return [(r - mu) / (sigma + eps) for r in rewards]
    if estimator is AdvantageEstimator.GRPO_SAMPLE:
        sigma = statistics.stdev(rewards)  # Bessel-corrected (torch.std default)
        return [(r - mu) / (sigma + eps) for r in rewards]
    if estimator is AdvantageEstimator.DR_GRPO:
        return [r - mu for r in rewards]
    # RLOO: r_i minus the mean of the other m - 1 rewards, computed from that definition.
    out = []
    for i, r in enumerate(rewards):
        others = rewards[:i] + rewards[i + 1 :]
        out.append(r - float(sum(Fraction(o) for o in others) / len(others)))
    return out


def assert_close_list(actual: torch.Tensor, expected: list[float], rel: float = 1e-12, abs_: float = 1e-12) -> None:
    assert actual.dtype == torch.float64
    assert actual.shape == (len(expected),)
    for a, e in zip(actual.tolist(), expected, strict=True):
        assert math.isclose(a, e, rel_tol=rel, abs_tol=abs_), (actual.tolist(), expected)


def test_epsilon_is_the_papers():
    assert GRPO_EPSILON == 1e-6


@pytest.mark.parametrize(
    "rewards",
    [
        [1.0, 0.0, 0.0, 1.0],
        [0.0, 0.0, 0.0, 1.0],
        [3.0, -1.0, 2.5],
        [0.25, 0.5, 0.75, 1.0, -2.0, 7.0],
        [10.0, 10.5],
    ],
)
@pytest.mark.parametrize("estimator", ALL)
def test_each_estimator_matches_its_explicit_formula(rewards, estimator):
    assert_close_list(group_advantages(rewards, estimator), expected_advantages(rewards, estimator))


def test_grpo_hand_computed_values():
    # rewards 1,0,0,1: mean 0.5, population std 0.5 -> A = ±0.5/(0.5+1e-6)
    a = 0.5 / (0.5 + 1e-6)
    assert_close_list(group_advantages([1.0, 0.0, 0.0, 1.0], AdvantageEstimator.GRPO), [a, -a, -a, a])
    # sample std of 1,0,0,1 is sqrt(1/3)
    s = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert_close_list(group_advantages([1.0, 0.0, 0.0, 1.0], AdvantageEstimator.GRPO_SAMPLE), [s, -s, -s, s])


def test_rloo_hand_computed_values():
    # r = (1, 2, 6): leave-one-out means are 4, 3.5, 1.5
    assert_close_list(group_advantages([1.0, 2.0, 6.0], AdvantageEstimator.RLOO), [-3.0, -1.5, 4.5])
    # and the same values equal m/(m-1) (r_i - mean) with mean 3
    assert_close_list(group_advantages([1.0, 2.0, 6.0], AdvantageEstimator.RLOO), [1.5 * (r - 3.0) for r in (1, 2, 6)])


def test_dr_grpo_is_plain_centering():
    assert_close_list(group_advantages([1.0, 2.0, 6.0], AdvantageEstimator.DR_GRPO), [-2.0, -1.0, 3.0])
    assert advantage_scale([1.0, 2.0, 6.0], AdvantageEstimator.DR_GRPO) == 1.0


def test_grpo_and_grpo_sample_differ_by_bessel():
    rewards = [0.0, 1.0]
    grpo = group_advantages(rewards, AdvantageEstimator.GRPO)
    sample = group_advantages(rewards, AdvantageEstimator.GRPO_SAMPLE)
    # population std 0.5, sample std sqrt(0.5)
    assert_close_list(grpo, [-0.5 / (0.5 + EPS), 0.5 / (0.5 + EPS)])
    assert_close_list(sample, [-0.5 / (math.sqrt(0.5) + EPS), 0.5 / (math.sqrt(0.5) + EPS)])
    assert not torch.allclose(grpo, sample)


def test_custom_eps_is_used():
    rewards = [0.0, 1.0]
    got = group_advantages(rewards, AdvantageEstimator.GRPO, eps=0.5)
    assert_close_list(got, [-0.5 / (0.5 + 0.5), 0.5 / (0.5 + 0.5)])
    assert math.isclose(advantage_scale(rewards, AdvantageEstimator.GRPO_SAMPLE, eps=0.25), 1 / (math.sqrt(0.5) + 0.25))


@pytest.mark.parametrize("estimator", ALL)
@pytest.mark.parametrize(
    "rewards", [[0.1, 0.1, 0.1], [0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [-0.3] * 7, [1e300, 1e300], [0.0, -0.0]]
)
def test_uniform_group_is_exactly_zero(estimator, rewards):
    # 0.1*3/3 != 0.1 in floating point, so a naive r - mean would leave a residue; the estimator must not.
    got = group_advantages(rewards, estimator)
    assert is_uniform(rewards)
    assert got.dtype == torch.float64
    assert torch.equal(got, torch.zeros(len(rewards), dtype=torch.float64))


def test_uniform_residue_would_exist_naively():
    # Guard that the uniform case above is a real test: the plain mean of three 0.1s is not 0.1.
    assert math.fsum([0.1, 0.1, 0.1]) / 3 != 0.1


@pytest.mark.parametrize("estimator", [AdvantageEstimator.GRPO_SAMPLE, AdvantageEstimator.RLOO])
def test_group_of_one_rejected_where_undefined(estimator):
    assert estimator.min_group_size == 2
    with pytest.raises(ValueError, match=estimator.value):
        advantage_scale([1.0], estimator)
    with pytest.raises(ValueError, match=estimator.value):
        group_advantages([1.0], estimator)  # uniform, but the size is still validated


@pytest.mark.parametrize("estimator", [AdvantageEstimator.GRPO, AdvantageEstimator.DR_GRPO])
def test_group_of_one_allowed_for_grpo_and_dr_grpo(estimator):
    assert estimator.min_group_size == 1
    got = group_advantages([0.7], estimator)
    assert torch.equal(got, torch.zeros(1, dtype=torch.float64))
    advantage_scale([0.7], estimator)  # no error


@pytest.mark.parametrize("estimator", ALL)
def test_empty_group_rejected(estimator):
    with pytest.raises(ValueError):
        advantage_scale([], estimator)
    with pytest.raises(ValueError):
        group_advantages([], estimator)


def test_estimator_parses_from_string():
    assert AdvantageEstimator("rloo") is AdvantageEstimator.RLOO
    assert AdvantageEstimator("grpo_sample") is AdvantageEstimator.GRPO_SAMPLE
    with pytest.raises(ValueError):
        AdvantageEstimator("ppo")


def test_group_mean_and_is_uniform():
    assert group_mean([1.0, 2.0, 6.0]) == 3.0
    # exactly rounded: 1e16 + 1 - 1e16 loses the 1 with naive summation
    assert group_mean([1e16, 1.0, -1e16]) == 1.0 / 3
    assert is_uniform([2.0])
    assert not is_uniform([2.0, 2.0, 2.0000000000000004])


reward_lists = st.lists(
    st.floats(min_value=-100.0, max_value=100.0, allow_nan=False, allow_infinity=False, allow_subnormal=False),
    min_size=2,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(rewards=reward_lists, estimator=st.sampled_from(ALL))
def test_group_advantages_is_scale_times_centered(rewards, estimator):
    got = group_advantages(rewards, estimator)
    assert got.shape == (len(rewards),) and got.dtype == torch.float64
    if len(set(rewards)) == 1:
        assert torch.equal(got, torch.zeros(len(rewards), dtype=torch.float64))
        return
    scale = advantage_scale(rewards, estimator)
    mu = exact_mean(rewards)
    spread = max(abs(r - mu) for r in rewards)
    tol = 1e-13 * max(1.0, scale * max(spread, max(abs(r) for r in rewards)))
    for a, r in zip(got.tolist(), rewards, strict=True):
        assert math.isclose(a, scale * (r - mu), rel_tol=1e-11, abs_tol=tol)
    # and against the estimator's own definition
    for a, e in zip(got.tolist(), expected_advantages(rewards, estimator), strict=True):
        assert math.isclose(a, e, rel_tol=1e-11, abs_tol=tol)


@settings(max_examples=150, deadline=None)
@given(rewards=reward_lists)
def test_grpo_advantages_have_zero_mean_and_bounded_std(rewards):
    got = group_advantages(rewards, AdvantageEstimator.GRPO)
    assert abs(float(got.mean())) < 1e-6
    # population std of (r - mu)/(sigma + eps) is sigma/(sigma + eps) <= 1
    assert float(got.std(correction=0)) <= 1.0 + 1e-9


@settings(max_examples=150, deadline=None)
@given(rewards=reward_lists)
def test_grpo_scale_is_inverse_population_std_plus_eps(rewards):
    sigma = statistics.pstdev(rewards)
    assert math.isclose(advantage_scale(rewards, AdvantageEstimator.GRPO), 1.0 / (sigma + 1e-6), rel_tol=1e-12)
    sample = statistics.stdev(rewards)
    assert math.isclose(advantage_scale(rewards, AdvantageEstimator.GRPO_SAMPLE), 1.0 / (sample + 1e-6), rel_tol=1e-12)
    m = len(rewards)
    assert advantage_scale(rewards, AdvantageEstimator.RLOO) == m / (m - 1)
    assert advantage_scale(rewards, AdvantageEstimator.DR_GRPO) == 1.0


@settings(max_examples=100, deadline=None)
@given(rewards=reward_lists)
def test_rloo_equals_leave_one_out_definition(rewards):
    got = group_advantages(rewards, AdvantageEstimator.RLOO).tolist()
    m = len(rewards)
    for i, a in enumerate(got):
        others = rewards[:i] + rewards[i + 1 :]
        loo = float(sum(Fraction(o) for o in others) / (m - 1))
        assert math.isclose(a, rewards[i] - loo, rel_tol=1e-9, abs_tol=1e-11)


@settings(max_examples=100, deadline=None)
@given(rewards=reward_lists, estimator=st.sampled_from(ALL))
def test_advantages_are_permutation_equivariant(rewards, estimator):
    forward = group_advantages(rewards, estimator).tolist()
    backward = group_advantages(rewards[::-1], estimator).tolist()[::-1]
    for a, b in zip(forward, backward, strict=True):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12)
