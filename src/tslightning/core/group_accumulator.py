"""Streaming GRPO statistics: per-group G1/G2 (Eq. 7) and the batch accumulator of group directions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tslightning.core.folding_queue import FoldingQueue
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.shard_layout import ShardLayout
from tslightning.objectives.advantages import GRPO_EPSILON, AdvantageEstimator, advantage_scale, group_mean, is_uniform


@dataclass
class _GroupStatistics:
    size: int
    shift: float  # c = the first reward folded in; see GroupAccumulator
    g1: torch.Tensor | None  # Σ (r_i − c) H_i over the folded sources (None: none folded)
    g2: torch.Tensor | None  # Σ H_i
    rewards: list[float]  # every counted source's reward: folded, or added to the batch directly


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

    With a :class:`~tslightning.core.shard_layout.ShardLayout` every vector is one rank's shard instead (FSDP2's
    dim-0 chunks, padded): ``(2·open_groups + 1) · shard numel`` values, and sources arrive as shards
    (:meth:`add_flat`).

    With a :class:`~tslightning.core.folding_queue.FoldingQueue` :meth:`add` folds on its background thread; what
    reads the statistics (:attr:`batch`, :meth:`close`) waits for the queued folds first.

    The first statistic is kept shifted, ``G1' = Σ (r_i − c) H_i`` with c the group's first reward; since
    ``G1 − μ G2 = G1' − (μ − c) G2`` this is the same update with less cancellation in FP32.

    A source served once its group's m rewards are known (a backlog pass, :mod:`tslightning.learner.batched_passes`)
    adds its final term A_i/m · H_i to the batch accumulator itself and is only counted here
    (:meth:`record_direct`): the group's close then combines the statistics of the sources folded before, if any.

    Precision bound (``dtype`` with unit roundoff u: 2^-24 for float32). Each coordinate of the batch accumulator,
    after n groups of at most m sources each whose gradients arrive in ``dtype`` or wider, is within

        (m + n + 3) · u · Σ_G ( |α_G| Σ_i |r_i − c_G| |H_i| + |β_G| Σ_i |H_i| ),   α_G = a_G/m,  β_G = −α_G (μ_G − c_G)

    of the exact Σ_G g_G (first order: m axpys into a group's statistic, 2 more at its close, n across groups, one
    for a gradient rounded to ``dtype``): sequential floating-point summation's γ bound on the terms actually added.
    ``tests/core/test_group_accumulator.py`` checks it coordinate by coordinate on real gradients.
    """

    def __init__(
        self,
        layout: ParameterLayout | ShardLayout,
        estimator: AdvantageEstimator = AdvantageEstimator.GRPO,
        eps: float = GRPO_EPSILON,
        dtype: torch.dtype = torch.float32,
        folding: FoldingQueue | None = None,
    ) -> None:
        self.layout = layout
        self.folding = folding
        self.estimator = AdvantageEstimator(estimator)
        self.eps = eps
        self.dtype = dtype
        self._batch = layout.zeros(dtype)
        self._open: dict[str, _GroupStatistics] = {}
        self.peak_held_numel = self.held_numel

    @property
    def batch(self) -> torch.Tensor:
        """The batch accumulator Σ_G g_G of the groups closed so far (after every queued fold has run)."""
        if self.folding is not None:
            self.folding.drain()
        return self._batch

    def batch_terms(self) -> list[tuple[torch.Tensor, float]]:
        """Where a gradient that is already part of g_k goes (a ``sync`` micro-batch, a prompt's deferred part):
        ``[(batch accumulator, 1)]``."""
        return [(self._batch, 1.0)]

    @property
    def held_numel(self) -> int:
        """Values currently held: the batch accumulator plus two vectors per open group holding statistics."""
        return self.layout.numel * (1 + 2 * sum(stats.g1 is not None for stats in self._open.values()))

    @property
    def open_groups(self) -> list[str]:
        return list(self._open)

    def add(self, group_id: str, group_size: int, reward: float, grads: Sequence[torch.Tensor]) -> None:
        """Fold one trajectory's source gradient H_i (as per-parameter tensors) and reward into its group (on the
        folding thread when there is one: ``grads`` must not change until it has run)."""
        if self.folding is None:
            self.add_flat(group_id, group_size, reward, self.layout.gather(grads, self.dtype))
            return
        self.folding.submit(lambda: self.add_flat(group_id, group_size, reward, self.layout.gather(grads, self.dtype)))

    def add_flat(self, group_id: str, group_size: int, reward: float, flat: torch.Tensor) -> None:
        """Fold H_i given as one flat vector in the layout's order (a shard under a ShardLayout), ``(numel,)``."""
        for statistic, alpha in self.source_terms(group_id, group_size, reward):
            statistic.add_(flat, alpha=alpha)
        self.record_source(group_id, reward)

    def source_terms(self, group_id: str, group_size: int, reward: float) -> list[tuple[torch.Tensor, float]]:
        """Where H_i of a source of ``group_id`` with ``reward`` goes: ``[(G1', r_i − c), (G2, 1)]`` (Eq. 7), the
        group's statistics allocated with its first source. Fold H_i — whole or a unit at a time — with
        ``statistic += alpha · H_i``, then :meth:`record_source` once."""
        stats = self._open.setdefault(group_id, _GroupStatistics(group_size, reward, None, None, []))
        if stats.g1 is None:
            stats.shift, stats.g1, stats.g2 = reward, self.layout.zeros(self.dtype), self.layout.zeros(self.dtype)
            self.peak_held_numel = max(self.peak_held_numel, self.held_numel)
        return [(stats.g1, reward - stats.shift), (stats.g2, 1.0)]

    def record_source(self, group_id: str, reward: float) -> None:
        """Count one folded source of ``group_id`` (after its terms of :meth:`source_terms` were folded)."""
        self._open[group_id].rewards.append(reward)

    def record_direct(self, group_id: str, group_size: int, reward: float) -> None:
        """Count a source of ``group_id`` whose final term a pass added to the batch accumulator itself (no
        statistics are allocated for it)."""
        self._open.setdefault(group_id, _GroupStatistics(group_size, reward, None, None, [])).rewards.append(reward)

    def folded(self, group_id: str) -> int:
        """Sources counted in open group ``group_id`` so far, folded or direct (0 if it has none)."""
        stats = self._open.get(group_id)
        return 0 if stats is None else len(stats.rewards)

    def is_complete(self, group_id: str) -> bool:
        """Whether every source of open group ``group_id`` has been counted (it can close)."""
        stats = self._open.get(group_id)
        return stats is not None and len(stats.rewards) == stats.size

    def close(self, group_id: str) -> GroupReduction:
        """Combine g_G = (a_G / m)(G1' − (μ − c) G2) into the batch accumulator and free the group's statistics.

        A uniform-reward group adds exactly nothing but still counts as reduced.
        """
        batch = self.batch  # waits for queued folds
        stats = self._open.pop(group_id)
        if len(stats.rewards) != stats.size:
            self._open[group_id] = stats
            raise RuntimeError(f"group {group_id!r} closed with {len(stats.rewards)} of {stats.size} sources folded in")
        mu = group_mean(stats.rewards)
        uniform = is_uniform(stats.rewards)
        scale = 0.0 if uniform else advantage_scale(stats.rewards, self.estimator, self.eps)
        if not uniform and stats.g1 is not None:
            # (a/m)·G1' − (a/m)(μ − c)·G2, each coefficient a float64 scalar applied once.
            batch.add_(stats.g1, alpha=scale / stats.size)
            batch.add_(stats.g2, alpha=-scale * (mu - stats.shift) / stats.size)
        return GroupReduction(group_id, tuple(stats.rewards), mu, scale, uniform)

    def reset(self) -> None:
        """Start a new logical batch: zero the batch accumulator, drop any open statistics."""
        if self.folding is not None:
            self.folding.discard()
        self._open.clear()
        self._batch = self.layout.placed(self._batch)
        self._batch.zero_()
        self.peak_held_numel = self.held_numel
