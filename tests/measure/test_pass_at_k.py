"""Pass@k (Eq. 31): the product form equals the binomial estimator and brute-force enumeration of k-subsets, and
the metric's summed count state merges exactly across metrics and ranks."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tslightning.measure.pass_at_k import PassAtK, pass_at_k


def enumerated(n: int, c: int, k: int) -> Fraction:
    """The share of k-subsets of the n attempts (c successes) that hold at least one success."""
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(outcomes, k))
    return Fraction(sum(any(subset) for subset in subsets), len(subsets))


def binomial(n: int, c: int, k: int) -> Fraction:
    """Eq. 31's term with exact binomials."""
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_product_form_equals_enumeration_of_k_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                estimate = pass_at_k(torch.tensor(n), torch.tensor(c), k)
                assert float(estimate) == pytest.approx(float(enumerated(n, c, k)), abs=1e-15), (n, c, k)


def test_hand_cases():
    n, c = torch.tensor([3, 3, 3, 5]), torch.tensor([0, 1, 3, 2])
    # n = k: solved at least once (Eq. 13's pass@3).
    assert pass_at_k(n[:3], c[:3], 3).tolist() == [0.0, 1.0, 1.0]
    # k = 1: the attempt success rate.
    assert pass_at_k(n, c, 1).tolist() == pytest.approx([0.0, 1 / 3, 1.0, 0.4])
    # 1 − C(3, 3)/C(5, 3) = 1 − 1/10.
    assert float(pass_at_k(torch.tensor(5), torch.tensor(2), 3)) == pytest.approx(0.9)
    # Fewer than k failures: certain success.
    assert float(pass_at_k(torch.tensor(5), torch.tensor(3), 3)) == 1.0


def test_large_n_is_numerically_stable():
    # C(20000, 1000) has thousands of digits; the product form never forms it.
    for n, c, k in [(20000, 1, 1000), (20000, 7, 1000), (5000, 4990, 2), (2000, 3, 1999)]:
        estimate = float(pass_at_k(torch.tensor(n), torch.tensor(c), k))
        assert estimate == pytest.approx(float(binomial(n, c, k)), rel=1e-12), (n, c, k)


def test_estimator_rejects_too_few_attempts_and_bad_counts():
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k(torch.tensor([3, 2]), torch.tensor([0, 0]), 3)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(torch.tensor(3), torch.tensor(4), 1)
    with pytest.raises(ValueError, match="k >= 1"):
        pass_at_k(torch.tensor(3), torch.tensor(1), 0)


def test_metric_averages_tasks_with_equal_weight():
    metric = PassAtK(k=[3, 1], tasks=["a", "b", "c"])
    metric.update(["a"] * 6, [True, False, False, False, False, False])  # n = 6, c = 1
    metric.update(["b", "b", "b", "c", "c", "c"], torch.tensor([0, 0, 0, 1, 1, 0]))
    scores = metric.compute()
    assert list(scores) == ["pass@1", "pass@3"]  # sorted ks
    assert float(scores["pass@1"]) == pytest.approx((1 / 6 + 0 + 2 / 3) / 3)
    assert float(scores["pass@3"]) == pytest.approx((0.5 + 0 + 1) / 3)
    assert metric.attempts.tolist() == [6, 3, 3] and metric.successes.tolist() == [1, 0, 2]


def test_metric_errors_name_k_and_the_tasks():
    metric = PassAtK(k=(1, 3), tasks=["a", "b"])
    metric.update(["a", "a", "a", "b", "b"], [True] * 5)
    with pytest.raises(ValueError, match=r"pass@3 needs at least k=3 .*: b$"):
        metric.compute()
    with pytest.raises(KeyError, match="zzz"):
        metric.update(["zzz"], [True])
    with pytest.raises(ValueError, match="2 task ids but 1 successes"):
        metric.update(["a", "b"], [True])
    unattempted = PassAtK(k=1, tasks=["a", "b"])  # a task never attempted stays in the denominator: an error
    unattempted.update(["a"], [True])
    with pytest.raises(ValueError, match="k=1 .*: b"):
        unattempted.compute()
    for bad in (0, [], [1, -2], 1.5):
        with pytest.raises(ValueError, match="positive integer"):
            PassAtK(k=bad, tasks=["a"])
    with pytest.raises(ValueError, match="distinct"):
        PassAtK(k=1, tasks=["a", "a"])


outcome_lists = st.lists(st.lists(st.booleans(), min_size=3, max_size=8), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(outcome_lists)
def test_metric_equals_exact_mean_and_is_monotone(per_task):
    tasks = [f"t{i}" for i in range(len(per_task))]
    metric = PassAtK(k=(1, 2, 3), tasks=tasks)
    attempts = [(t, y) for t, outcomes in zip(tasks, per_task, strict=True) for y in outcomes]
    metric.update([t for t, _ in attempts], [y for _, y in attempts])
    scores = {name: float(value) for name, value in metric.compute().items()}
    for k in (1, 2, 3):
        exact = sum(binomial(len(o), sum(o), k) for o in per_task) / len(per_task)
        assert scores[f"pass@{k}"] == pytest.approx(float(exact), abs=1e-12)
        assert 0.0 <= scores[f"pass@{k}"] <= 1.0
    assert scores["pass@1"] <= scores["pass@2"] + 1e-12 <= scores["pass@3"] + 2e-12


@settings(max_examples=60, deadline=None)
@given(outcome_lists, st.randoms(use_true_random=False))
def test_split_state_merges_exactly(per_task, rng):
    """However attempts are split (across updates, metrics or ranks), summed counts give the same scores."""
    tasks = [f"t{i}" for i in range(len(per_task))]
    attempts = [(t, y) for t, outcomes in zip(tasks, per_task, strict=True) for y in outcomes]
    rng.shuffle(attempts)
    cut = rng.randrange(len(attempts) + 1)
    whole, first, second = (PassAtK(k=(1, 3), tasks=tasks) for _ in range(3))
    whole.update([t for t, _ in attempts], [y for _, y in attempts])
    for metric, part in ((first, attempts[:cut]), (second, attempts[cut:])):
        metric.update([t for t, _ in part], [y for _, y in part])  # possibly no attempts at all
    first.merge_state(second)
    assert torch.equal(first.attempts, whole.attempts) and torch.equal(first.successes, whole.successes)
    assert {n: float(v) for n, v in first.compute().items()} == {n: float(v) for n, v in whole.compute().items()}


def test_rank_sync_sums_the_count_state():
    """``compute`` through a stand-in all-gather of two ranks: every state is summed, and a rank that alone has too
    few attempts on a task still computes the global score; its local counts come back afterwards."""
    tasks = ["a", "b"]
    peer = PassAtK(k=(1, 3), tasks=tasks)
    peer.update(["a", "b", "b"], [False, False, True])
    peer_states = iter([peer.attempts, peer.successes])  # all-gather runs once per state, in registration order

    def all_gather(tensor, group=None):
        return [tensor, next(peer_states)]

    rank0 = PassAtK(k=(1, 3), tasks=tasks, dist_sync_fn=all_gather, distributed_available_fn=lambda: True)
    rank0.update(["a", "a", "b"], [True, False, False])
    single = PassAtK(k=(1, 3), tasks=tasks)
    single.update(["a", "a", "b", "a", "b", "b"], [True, False, False, False, False, True])
    assert {n: float(v) for n, v in rank0.compute().items()} == {n: float(v) for n, v in single.compute().items()}
    assert rank0.attempts.tolist() == [2, 1] and rank0.successes.tolist() == [1, 0]
