"""One update's stream as the learner consumes it: its :class:`~tslightning.core.batch_registry.BatchPlan`, then
sources and completion events in readiness order, ``BatchClosed`` last — and, without waiting, every item that is
ready now (:meth:`ReadyItems.take_ready`): the backlog a busy learner serves in padded passes
(:mod:`tslightning.learner.batched_serving`).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed, StreamItem
from tslightning.rollout.continuous_rollout import RolloutFailure

__all__ = ["ReadyItems"]

Start = Callable[[], tuple[BatchPlan, Callable[[queue.Queue], threading.Thread]]]
"""Stamps the update's plan and returns it with a function that starts the producer thread feeding a queue."""


class ReadyItems(Iterator):
    """The items of update ``update``, produced by a rollout thread that starts once the plan has been taken.

    ``next`` blocks for the next item; :meth:`take_ready` returns the items already ready. A producer's failure is
    raised as ``RuntimeError`` by the call that reaches it (after the items before it were handed out).
    """

    def __init__(self, update: int, start: Start) -> None:
        self.update = update
        self._start = start
        self._queue: queue.Queue | None = None
        self._producer: threading.Thread | None = None
        self._begin: Callable[[queue.Queue], threading.Thread] | None = None
        self._done = False

    def __iter__(self) -> ReadyItems:
        return self

    def __next__(self) -> BatchPlan | StreamItem:
        if self._done:
            raise StopIteration
        if self._begin is None and self._queue is None:
            plan, self._begin = self._start()
            return plan
        return self._take(self._producer_queue().get())

    def take_ready(self) -> list[StreamItem]:
        """Every item ready now, in readiness order, without waiting (``[]`` before the plan was taken)."""
        items: list[StreamItem] = []
        while self._queue is not None and not self._done:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, RolloutFailure) and items:
                self._queue.queue.appendleft(item)  # raised by the next call, once these are served
                break
            items.append(self._take(item))
        return items

    def _producer_queue(self) -> queue.Queue:
        if self._queue is None:
            self._queue = queue.Queue()
            self._producer = self._begin(self._queue)
        return self._queue

    def _take(self, item: Any) -> StreamItem:
        if isinstance(item, RolloutFailure):
            self._finish()
            raise RuntimeError(f"rollout of update {self.update} failed: {item.error}") from item.error
        if isinstance(item, BatchClosed):
            self._finish()
        return item

    def _finish(self) -> None:
        self._done = True
        if self._producer is not None:
            self._producer.join()
