"""Streaming OPD accumulation (Eqs. 8-9): an unnormalized gradient sum and the scored-token count N_k."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tslightning.core.parameter_layout import ParameterLayout


class TurnAccumulator:
    """Σ_j g_j and N_k = Σ_j |M_j| over the turns folded in so far.

    N_k is only known when the logical batch closes, so the division of Eq. 9 happens at the barrier
    (:meth:`direction`), after the cross-rank sum of both the vector and the count.
    """

    def __init__(self, layout: ParameterLayout, dtype: torch.dtype = torch.float32) -> None:
        self.layout = layout
        self.dtype = dtype
        self.total = layout.zeros(dtype)
        self.num_tokens = 0

    @property
    def held_numel(self) -> int:
        return self.layout.numel

    def add(self, grads: Sequence[torch.Tensor], num_scored: int) -> None:
        """Fold one turn's unnormalized g_j (per-parameter tensors) and its |M_j| scored tokens."""
        self.layout.add_(self.total, grads)
        self.num_tokens += num_scored

    def reset(self) -> None:
        self.total = self.layout.placed(self.total)
        self.total.zero_()
        self.num_tokens = 0
