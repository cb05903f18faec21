"""Streaming OPD accumulation (Eqs. 8-9): an unnormalized gradient sum and the scored-token count N_k."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tslightning.core.folding_queue import FoldingQueue
from tslightning.core.parameter_layout import ParameterLayout


class TurnAccumulator:
    """Σ_j g_j and N_k = Σ_j |M_j| over the turns folded in so far.

    N_k is only known when the logical batch closes, so the division of Eq. 9 happens at the barrier
    (:meth:`direction`), after the cross-rank sum of both the vector and the count.
    """

    def __init__(
        self, layout: ParameterLayout, dtype: torch.dtype = torch.float32, folding: FoldingQueue | None = None
    ) -> None:
        self.layout = layout
        self.dtype = dtype
        self.folding = folding
        """Where :meth:`add` folds (a background thread), or ``None``: on the caller's thread."""
        self._total = layout.zeros(dtype)
        self.num_tokens = 0

    @property
    def total(self) -> torch.Tensor:
        """Σ_j g_j of the turns added so far (after every queued fold has run)."""
        if self.folding is not None:
            self.folding.drain()
        return self._total

    @property
    def held_numel(self) -> int:
        return self.layout.numel

    def add(self, grads: Sequence[torch.Tensor], num_scored: int) -> None:
        """Fold one turn's unnormalized g_j (per-parameter tensors) and its |M_j| scored tokens."""
        if self.folding is None:
            self.layout.add_(self._total, grads)
        else:
            self.folding.submit(lambda: self.layout.add_(self._total, grads))
        self.num_tokens += num_scored

    def terms(self) -> list[tuple[torch.Tensor, float]]:
        """Where a turn's g_j goes, folded whole or a unit at a time: ``[(Σ_j g_j, 1)]``; then :meth:`count` its
        tokens."""
        return [(self._total, 1.0)]

    def count(self, num_scored: int) -> None:
        """Add one folded turn's |M_j| to N_k."""
        self.num_tokens += num_scored

    def reset(self) -> None:
        if self.folding is not None:
            self.folding.discard()
        self._total = self.layout.placed(self._total)
        self._total.zero_()
        self.num_tokens = 0
