"""Per-rank admission cap on GRPO groups holding statistics (App. D.3).

With a cap k, a source of a *new* group waits while k groups on this rank hold G1/G2 statistics; only its
tokens wait, never its reward. Sources of groups already holding statistics are always admitted, so every
open group can close and the queue never deadlocks. Within a group, readiness order is preserved.
Pure scheduling: no tensors, so it is testable on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

Item = TypeVar("Item")


class GroupAdmission(Generic[Item]):
    """Admit work items per group, at most ``cap`` groups open at once (``cap=None``: unbounded)."""

    def __init__(self, cap: int | None = None) -> None:
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            raise ValueError(f"group_admission_cap must be None (no cap) or an int >= 1; got {cap!r}")
        self.cap = cap
        self.open: set[str] = set()
        self._waiting: OrderedDict[str, list[Item]] = OrderedDict()

    def offer(self, group_id: str, item: Item) -> list[Item]:
        """Offer one ready item; returns the items admitted now (``[item]`` or ``[]`` if it must wait)."""
        if group_id in self.open:
            return [item]
        if group_id not in self._waiting and (self.cap is None or len(self.open) < self.cap):
            self.open.add(group_id)
            return [item]
        self._waiting.setdefault(group_id, []).append(item)
        return []

    def release(self, group_id: str) -> list[Item]:
        """Group ``group_id`` freed its statistics; admit waiting groups in arrival order, return their items."""
        self.open.discard(group_id)
        admitted: list[Item] = []
        while self._waiting and (self.cap is None or len(self.open) < self.cap):
            next_group, items = self._waiting.popitem(last=False)
            self.open.add(next_group)
            admitted.extend(items)
        return admitted

    @property
    def num_waiting(self) -> int:
        """Items held back by the cap."""
        return sum(len(items) for items in self._waiting.values())

    def reset(self) -> None:
        self.open.clear()
        self._waiting.clear()
