"""The rollout's tail, read from a release trace: how long an update waits for its last trajectories after most are
in, how fast those last ones generated, and what speculative decoding accepted.

Per update, with trajectories ordered by ready time (a GRPO source's τ_j; an OPD trajectory's last turn's), the
tail τ runs from the ready time of the trajectory at the ``quantile`` (the 90th percentile: the ⌈0.9·n⌉-th) to the
last one's. The trajectories ready after the quantile's are the tail's; their tokens per second is their sampled
tokens over their requests' seconds — what one long trajectory decoding nearly alone gets from the engine.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["RolloutTail", "rollout_tail"]


@dataclass(frozen=True)
class RolloutTail:
    """One update's tail (seconds unless named otherwise).

    Attributes:
        tail_s: τ, from the quantile trajectory's ready time to the last one's.
        tail_tokens: Tokens the tail's trajectories sampled.
        tail_generation_s: Seconds their generation requests took.
        drafted: Draft tokens speculative decoding proposed over the update's sources (0: none speculated).
        accepted: Draft tokens it accepted.
    """

    tail_s: float
    tail_tokens: int
    tail_generation_s: float
    drafted: int
    accepted: int

    @property
    def tail_tokens_per_s(self) -> float:
        """The tail's sampled tokens per second of generation (``nan`` without generation records)."""
        return self.tail_tokens / self.tail_generation_s if self.tail_generation_s > 0 else math.nan


def rollout_tail(records: Iterable[Mapping[str, Any]], quantile: float = 0.9) -> RolloutTail:
    """The tail of one update's source records (one rank's, or every rank's).

    Raises:
        ValueError: if ``records`` hold no source, or ``quantile`` is outside (0, 1].
    """
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1]; got {quantile}")
    trajectories = _trajectories([r for r in records if r.get("record", "source") == "source"])
    if not trajectories:
        raise ValueError("rollout_tail needs the source records of an update; got none")
    ordered = sorted(trajectories.values(), key=lambda t: t["ready_time"])
    cut = ordered[max(0, math.ceil(quantile * len(ordered)) - 1)]["ready_time"]
    tail = [t for t in ordered if t["ready_time"] > cut]
    return RolloutTail(
        tail_s=ordered[-1]["ready_time"] - cut,
        tail_tokens=sum(t["generated_tokens"] for t in tail),
        tail_generation_s=sum(t["generation_s"] for t in tail),
        drafted=sum(t["drafted"] for t in ordered),
        accepted=sum(t["accepted"] for t in ordered),
    )


def _trajectories(sources: Sequence[Mapping[str, Any]]) -> dict[tuple, dict[str, float]]:
    """Per (rank, group, trajectory): its ready time (its last source's) and its sources' generation summed (a record
    naming no trajectory is one of its own)."""
    merged: dict[tuple, dict[str, float]] = defaultdict(
        lambda: {"ready_time": -math.inf, "generated_tokens": 0, "generation_s": 0.0, "drafted": 0, "accepted": 0}
    )
    for index, source in enumerate(sources):
        named = "group" in source and "trajectory" in source
        key = (source.get("rank", 0), source["group"], source["trajectory"]) if named else ("record", index)
        entry = merged[key]
        entry["ready_time"] = max(entry["ready_time"], source["ready_time"])
        entry["generated_tokens"] += source.get("generated_tokens") or 0
        entry["generation_s"] += source.get("generation_s") or 0.0
        entry["drafted"] += source.get("spec_drafted") or 0
        entry["accepted"] += source.get("spec_accepted") or 0
    return dict(merged)
