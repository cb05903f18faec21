"""What a pass's gradient contributes to: a GRPO group's statistics, or the batch accumulator."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Contribution:
    """Where one pass's gradient is folded: a trajectory's H_i into its group's G1'/G2 with its reward (Eq. 7), or —
    ``group_id`` ``None`` — straight into the accumulator of the batch direction (a ``sync`` micro-batch, a closed
    group's prompt part, an OPD turn's g_j of Eq. 8).

    With sharded statistics it travels to every rank with the gradient's shards (a control message), so each rank
    folds its shard into the right statistics.
    """

    group_id: str | None
    group_size: int = 0
    reward: float = 0.0
    completes: bool = True
    """Whether this pass completes its source (the last of its sequences): only then is the source counted in its
    group (a trajectory of several sequences folds one pass per sequence, with the same reward)."""

    @property
    def into_batch(self) -> bool:
        """Whether the gradient goes straight into the batch accumulator."""
        return self.group_id is None


BATCH = Contribution(None)
"""A gradient that is already part of the batch direction's sum."""
