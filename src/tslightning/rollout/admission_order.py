"""Which attempts of an update start first: in task order, or the longest-predicted first, so the trajectories most
likely to form the rollout's tail start in its first wave instead of its last.

Only the start order changes. Every attempt is still sampled with the seed of (run, update, task, trajectory, turn)
(:func:`~tslightning.rollout.engine.sampling_seed`), so the set of sampled trajectories — prompts, group sizes,
seeds — is the one the task order gives; nothing is dropped, resampled or cut, and no trajectory's chance of being in
the batch depends on its length (that would bias GRPO toward short answers).

The prediction is the task's sampled tokens per trajectory in the last update that rolled it out on this rank
(:class:`LengthHistory`); a task seen for the first time counts as the longest: starting an unknown attempt early can
only shorten the tail.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Literal, TypeVar

__all__ = ["AdmissionOrder", "LengthHistory"]

AdmissionOrder = Literal["task", "longest_first"]
"""``task``: groups start in the update's task order; ``longest_first``: by predicted length, longest first."""

Group = TypeVar("Group")


class LengthHistory:
    """Per task, the mean sampled tokens of its trajectories in the last update that rolled it out."""

    def __init__(self) -> None:
        self._tokens: dict[str, float] = {}

    def record(self, trajectories: Iterable[Any]) -> None:
        """Remember each task's mean sampled tokens over ``trajectories`` (one update's)."""
        totals: dict[str, list[int]] = {}
        for trajectory in trajectories:
            sampled = sum(len(turn.action_token_ids) for turn in trajectory.turns)
            totals.setdefault(trajectory.task_id, []).append(sampled)
        self._tokens |= {task: sum(counts) / len(counts) for task, counts in totals.items()}

    def predicted(self, task_id: str) -> float:
        """Sampled tokens a trajectory of ``task_id`` is expected to take (``inf``: never seen)."""
        return self._tokens.get(task_id, math.inf)

    def longest_first(self, groups: Mapping[str, Group], task_of: Mapping[str, str]) -> dict[str, Group]:
        """``groups`` (group id → anything) reordered longest-predicted first, ties in their given order."""
        ranked = sorted(enumerate(groups), key=lambda pair: (-self.predicted(task_of[pair[1]]), pair[0]))
        return {group: groups[group] for _, group in ranked}
