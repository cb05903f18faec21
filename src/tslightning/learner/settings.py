"""The streaming module's settings: when learner work runs (:class:`Schedule`) and the optimizer (Table 5)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal


class Schedule(StrEnum):
    """When learner work runs inside one update; both are zero-staleness (Sec. 3.3)."""

    SYNC = "sync"
    THUNDERSYNC = "thundersync"


@dataclass
class OptimizerSettings:
    """AdamW as in Table 5 (full fine-tuning; use lr=1e-5 for LoRA)."""

    lr: float = 1e-6
    """Learning rate, constant (no schedule, no warm-up)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's β1, β2: decay rates of the first and second moment estimates, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's ε, added to the root of the second moment."""
    weight_decay: float = 0.0
    """Decoupled weight decay (0: none, as in Table 5)."""
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    """dtype of AdamW's two moments: ``bfloat16`` halves the optimizer state (Table 5's "Adam state BF16";
    :class:`~tslightning.learner.compact_adamw.CompactAdamW`), the update itself stays in the master weights'
    dtype."""
