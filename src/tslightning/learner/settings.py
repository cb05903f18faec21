"""The streaming module's settings: when learner work runs (:class:`Schedule`) and the optimizer (Table 5)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Schedule(StrEnum):
    """When learner work runs inside one update; both are zero-staleness (SPEC §3)."""

    SYNC = "sync"
    THUNDERSYNC = "thundersync"


@dataclass
class OptimizerSettings:
    """AdamW as in Table 5 (full fine-tuning; use lr=1e-5 for LoRA)."""

    lr: float = 1e-6
    """Learning rate, constant (no schedule, no warm-up)."""
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
