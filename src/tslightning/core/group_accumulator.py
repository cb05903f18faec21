"""Streaming GRPO statistics: per-group G1/G2 (Eq. 7) and the batch accumulator of group directions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tslightning.core.parameter_layout import ParameterLayout
from tslightning.objectives.advantages import GRPO_EPSILON, AdvantageEstimator, advantage_scale, group_mean, is_uniform


@dataclass
class _GroupStatistics:
    size: int
    shift: float  # c = the first reward folded in; see GroupAccumulator
    g1: torch.Tensor  # Σ (r_i − c) H_i
    g2: torch.Tensor  # Σ H_i
    rewards: list[float]


@dataclass(frozen=True)
class GroupReduction:
    """What closing one group contributed: its statistics and the advantage scale a_G (0 when uniform)."""

    group_id: str
    rewards: tuple[float, ...]
    mean: float
    scale: float
    uniform: bool


class GroupAccumulator:
    """Open groups' statistics and the batch direction g_k = Σ_G g_G (Eqs. 6-7).

    Each open group holds two flat vectors over the trainable parameters, allocated with the group's first
    source and freed when it closes; the batch accumulator is one more. Held memory is therefore
    ``(2·open_groups + 1) · numel`` values of ``dtype`` (App. D.3), tracked in :attr:`peak_held_numel`.

    The first statistic is kept shifted, ``G1' = Σ (r_i − c) H_i`` with c the group's first reward; since
    ``G1 − μ G2 = G1' − (μ − c) G2`` this is the same update with less cancellation in FP32.
    """

    def __init__(
        self,
        layout: ParameterLayout,
        estimator: AdvantageEstimator = AdvantageEstimator.GRPO,
        eps: float = GRPO_EPSILON,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.layout = layout
        self.estimator = AdvantageEstimator(estimator)
        self.eps = eps
        self.dtype = dtype
        self.batch = layout.zeros(dtype)
        self._open: dict[str, _GroupStatistics] = {}
        self.peak_held_numel = self.held_numel

    @property
    def held_numel(self) -> int:
        """Values currently held: the batch accumulator plus two vectors per open group."""
        return self.layout.numel * (1 + 2 * len(self._open))

    @property
    def open_groups(self) -> list[str]:
        return list(self._open)

    def add(self, group_id: str, group_size: int, reward: float, grads: Sequence[torch.Tensor]) -> None:
        """Fold one trajectory's source gradient H_i (as per-parameter tensors) and reward into its group."""
        stats = self._open.get(group_id)
        if stats is None:
            stats = _GroupStatistics(
                group_size, reward, self.layout.zeros(self.dtype), self.layout.zeros(self.dtype), []
            )
            self._open[group_id] = stats
            self.peak_held_numel = max(self.peak_held_numel, self.held_numel)
        flat = self.layout.gather(grads, self.dtype)  # one copy of H_i where the statistics live
        stats.g1.add_(flat, alpha=reward - stats.shift)
        stats.g2.add_(flat)
        stats.rewards.append(reward)

    def close(self, group_id: str) -> GroupReduction:
        """Combine g_G = (a_G / m)(G1' − (μ − c) G2) into the batch accumulator and free the group's statistics.

        A uniform-reward group adds exactly nothing but still counts as reduced.
        """
        stats = self._open.pop(group_id)
        if len(stats.rewards) != stats.size:
            self._open[group_id] = stats
            raise RuntimeError(f"group {group_id!r} closed with {len(stats.rewards)} of {stats.size} sources folded in")
        mu = group_mean(stats.rewards)
        uniform = is_uniform(stats.rewards)
        scale = 0.0 if uniform else advantage_scale(stats.rewards, self.estimator, self.eps)
        if not uniform:
            # (a/m)·G1' − (a/m)(μ − c)·G2, each coefficient a float64 scalar applied once.
            self.batch.add_(stats.g1, alpha=scale / stats.size)
            self.batch.add_(stats.g2, alpha=-scale * (mu - stats.shift) / stats.size)
        return GroupReduction(group_id, tuple(stats.rewards), mu, scale, uniform)

    def reset(self) -> None:
        """Start a new logical batch: zero the batch accumulator, drop any open statistics."""
        self._open.clear()
        self.batch = self.layout.placed(self.batch)
        self.batch.zero_()
        self.peak_held_numel = self.held_numel
