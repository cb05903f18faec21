"""One objective's streaming statistics over one space, and where each pass's gradient folds into them.

GRPO keeps the open groups' G1'/G2 and the batch accumulator Σ_G g_G (Eq. 7,
:class:`~tslightning.core.group_accumulator.GroupAccumulator`); OPD keeps Σ_j g_j and N_k (Eq. 9,
:class:`~tslightning.core.turn_accumulator.TurnAccumulator`). The space is the whole parameter layout, or this
rank's shard of it (:class:`~tslightning.core.shard_layout.ShardLayout`) when the statistics are sharded. Only the
objective's own accumulator is allocated: a parameter-sized vector is 30 GiB at 7B.
"""

from __future__ import annotations

import torch

from tslightning.core.batch_registry import Objective
from tslightning.core.contribution import Contribution
from tslightning.core.folding_queue import FoldingQueue
from tslightning.core.group_accumulator import GroupAccumulator
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.shard_layout import ShardLayout
from tslightning.core.turn_accumulator import TurnAccumulator
from tslightning.objectives.advantages import AdvantageEstimator

Terms = list[tuple[torch.Tensor, float]]
"""``[(statistic, alpha)]``: a gradient g folds as ``statistic += alpha · g`` for each."""


class StreamingStatistics:
    """The accumulators of ``objective`` over ``space``.

    Args:
        space: The whole layout, or this rank's shard of it.
        objective: GRPO or OPD.
        estimator, eps, dtype: As for :class:`GroupAccumulator` (dtype: the statistics' precision).
        folding: The folding thread whose queued folds must land before anything reads the statistics.
    """

    def __init__(
        self,
        space: ParameterLayout | ShardLayout,
        objective: Objective,
        estimator: AdvantageEstimator,
        eps: float,
        dtype: torch.dtype,
        folding: FoldingQueue | None = None,
    ) -> None:
        self.space = space
        self.objective = Objective(objective)
        grpo = self.objective is Objective.GRPO
        self.groups = GroupAccumulator(space, estimator, eps, dtype, folding) if grpo else None
        """GRPO's open groups and batch accumulator (``None`` for OPD)."""
        self.turns = None if grpo else TurnAccumulator(space, dtype, folding)
        """OPD's Σ_j g_j and N_k (``None`` for GRPO)."""

    @property
    def dtype(self) -> torch.dtype:
        return (self.groups or self.turns).dtype

    def terms(self, contribution: Contribution) -> Terms:
        """Where a gradient of ``contribution`` folds (the group's statistics allocated with its first source)."""
        if contribution.group_id is None:
            return self.groups.batch_terms() if self.groups is not None else self.turns.terms()
        if self.groups is None:
            raise ValueError(f"an OPD learner got a gradient for GRPO group {contribution.group_id!r}")
        return self.groups.source_terms(contribution.group_id, contribution.group_size, contribution.reward)

    def record(self, contribution: Contribution) -> None:
        """Count a folded source of a GRPO group (after all its units' terms were folded, and its last pass)."""
        if contribution.group_id is not None and contribution.completes:
            self.groups.record_source(contribution.group_id, contribution.reward)

    @property
    def accumulator(self) -> torch.Tensor:
        """The batch direction's running sum (GRPO Σ_G g_G, OPD Σ_j g_j), after every queued fold."""
        return self.groups.batch if self.groups is not None else self.turns.total

    @property
    def held_numel(self) -> int:
        """Values held now (GRPO: batch + 2 per open group; OPD: the sum)."""
        return (self.groups or self.turns).held_numel

    @property
    def peak_held_numel(self) -> int:
        """Most values held at once since the last reset."""
        return self.groups.peak_held_numel if self.groups is not None else self.turns.held_numel

    def reset(self) -> None:
        """Start a new logical batch (zeroed, re-placed where the statistics live now)."""
        (self.groups or self.turns).reset()
