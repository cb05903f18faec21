"""Chi-squared tests for "these tokens were sampled from that distribution" (no scipy: the χ² tail is torch's
regularized upper incomplete gamma, sf(x; d) = Q(d/2, x/2))."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch


def chi2_sf(statistic: float, dof: int) -> float:
    """P(χ²_dof ≥ statistic)."""
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


def homogeneity_p_value(a: Sequence, b: Sequence, min_expected: float = 5.0) -> float:
    """χ² test that samples ``a`` and ``b`` (hashable outcomes) come from one distribution; outcomes too rare for the
    χ² approximation (expected count below ``min_expected`` in either sample) are pooled into one cell."""
    counts_a, counts_b = Counter(a), Counter(b)
    n_a, n_b = len(a), len(b)
    cells: list[tuple[int, int]] = []
    rare = [0, 0]
    for outcome in set(counts_a) | set(counts_b):
        x, y = counts_a[outcome], counts_b[outcome]
        total = x + y
        if min(total * n_a, total * n_b) / (n_a + n_b) < min_expected:
            rare[0] += x
            rare[1] += y
        else:
            cells.append((x, y))
    if sum(rare):
        cells.append((rare[0], rare[1]))
    statistic = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            statistic += (observed - expected) ** 2 / expected
    return chi2_sf(statistic, len(cells) - 1)


def goodness_of_fit_p_value(samples: Sequence[int], probabilities: torch.Tensor, min_expected: float = 5.0) -> float:
    """χ² test that ``samples`` (token ids) were drawn from ``probabilities`` (over the ids), rare ids pooled."""
    counts = Counter(samples)
    n = len(samples)
    statistic, cells, pooled_observed, pooled_expected = 0.0, 0, 0, 0.0
    for token, p in enumerate(probabilities.tolist()):
        expected = n * p
        if expected < min_expected:
            pooled_observed += counts[token]
            pooled_expected += expected
            continue
        statistic += (counts[token] - expected) ** 2 / expected
        cells += 1
    if pooled_expected > 0:
        statistic += (pooled_observed - pooled_expected) ** 2 / pooled_expected
        cells += 1
    return chi2_sf(statistic, cells - 1)


def detectable_shift(samples_per_arm: int, p: float = 0.5, z_alpha: float = 3.29, z_beta: float = 0.84) -> float:
    """The smallest change of one token's frequency ``p`` a two-sample test with ``samples_per_arm`` each detects at
    two-sided level α (z 3.29: α = 0.001) with power 1 − β (z 0.84: 80%), by the normal approximation."""
    return (z_alpha + z_beta) * (2 * p * (1 - p) / samples_per_arm) ** 0.5
