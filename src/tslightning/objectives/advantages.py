"""Group-relative advantages that stream exactly (Eqs. 5-7).

Every estimator offered here has the form ``A_i = a_G · (r_i − μ_G)``: a group-level scale ``a_G`` times the
reward's deviation from the group mean. Because the advantage is affine in r_i given its group, the group
direction ``g_G = (1/m) Σ_i A_i H_i`` decomposes into the two running sums ``G1 = Σ r_i H_i`` and ``G2 = Σ H_i``
(Eq. 7) that the learner accumulates before the group's last reward is known:

    g_G = (a_G / m) · (G1 − μ_G · G2)

=================  ====================================  ============================
estimator          a_G                                   used by
=================  ====================================  ============================
``grpo``           1 / (σ_pop + ε)                       the paper (Eq. 6), default
``grpo_sample``    1 / (σ_sample + ε)                    TRL / verl ``norm_adv`` with torch.std
``dr_grpo``        1                                     Dr. GRPO (no std scaling)
``rloo``           m / (m − 1)                           RLOO: r_i − mean of the others
=================  ====================================  ============================

A uniform-reward group (all r_i equal) has every advantage exactly zero under every estimator; it is
detected explicitly so its contribution is an exact zero rather than a rounding residue.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

import torch

GRPO_EPSILON = 1e-6
"""ε of Eq. 6 (Table 5, 'Advantage stabilization')."""


class AdvantageEstimator(StrEnum):
    """Which group-relative advantage to stream; all are exact (see the module docstring)."""

    GRPO = "grpo"
    GRPO_SAMPLE = "grpo_sample"
    DR_GRPO = "dr_grpo"
    RLOO = "rloo"

    @property
    def min_group_size(self) -> int:
        """Smallest group for which the estimator is defined (sample std and leave-one-out need two)."""
        return 2 if self in (AdvantageEstimator.GRPO_SAMPLE, AdvantageEstimator.RLOO) else 1


def group_mean(rewards: Sequence[float]) -> float:
    """μ_G of Eq. 5, computed with exactly rounded summation."""
    return math.fsum(rewards) / len(rewards)


def is_uniform(rewards: Sequence[float]) -> bool:
    """True when every reward equals the first, i.e. the group carries no learning signal."""
    return all(r == rewards[0] for r in rewards)


def advantage_scale(rewards: Sequence[float], estimator: AdvantageEstimator, eps: float = GRPO_EPSILON) -> float:
    """The group-level scale a_G with ``A_i = a_G · (r_i − μ_G)``.

    Args:
        rewards: The m rewards of one closed group, in any order.
        estimator: Which advantage (module docstring table).
        eps: ε added to the standard deviation (Eq. 6); unused by ``dr_grpo`` and ``rloo``.
    """
    m = len(rewards)
    if m < estimator.min_group_size:
        raise ValueError(
            f"advantage estimator {estimator.value!r} needs groups of >= {estimator.min_group_size}; got {m}"
        )
    mu = group_mean(rewards)
    # A uniform group's mean can round off its common value; its spread is exactly zero.
    squared = 0.0 if is_uniform(rewards) else math.fsum((r - mu) ** 2 for r in rewards)
    if estimator is AdvantageEstimator.GRPO:
        return 1.0 / (math.sqrt(squared / m) + eps)
    if estimator is AdvantageEstimator.GRPO_SAMPLE:
        return 1.0 / (math.sqrt(squared / (m - 1)) + eps)
    if estimator is AdvantageEstimator.DR_GRPO:
        return 1.0
    return m / (m - 1)


def group_advantages(
    rewards: Sequence[float], estimator: AdvantageEstimator, eps: float = GRPO_EPSILON
) -> torch.Tensor:
    """Batch form: the float64 advantages ``(m,)`` of one group, exactly zero for a uniform group.

    This is what a batch-synchronous trainer computes once the whole group is in; the streaming learner
    never materializes it, and tests compare the two.
    """
    if is_uniform(rewards):
        advantage_scale(rewards, estimator, eps)  # still validates the group size
        return torch.zeros(len(rewards), dtype=torch.float64)
    scale = advantage_scale(rewards, estimator, eps)
    mu = group_mean(rewards)
    return torch.tensor([scale * (r - mu) for r in rewards], dtype=torch.float64)
