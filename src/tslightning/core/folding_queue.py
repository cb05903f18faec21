"""Folding source gradients into the streaming statistics off the learner thread (``learner.fold_queue_depth``).

Folding one source — copying its gradient to where the statistics live (device → page-locked host on a GPU) and the
two axpys of Eq. 7 — does not need the learner thread, which could already run the next source's forward. A
:class:`FoldingQueue` runs folds on one background thread (a one-worker ``ThreadPoolExecutor``) in submission order,
so the statistics see exactly the operations, in exactly the order, of folding on the learner thread: the update is
bitwise the same. The queue is bounded: :meth:`FoldingQueue.submit` blocks while ``depth`` folds are pending, since
each pending fold keeps its source's gradient alive (``depth`` more gradient-sized buffers on the device at most).
Whatever reads the statistics (a group's close, the barrier) first :meth:`FoldingQueue.drain`\\ s the queue.

On a CUDA machine the fold runs on a side stream that first waits for an event recorded on the learner's stream at
submission, so the copies start only once the backward that produced the gradient has, and never block the learner's
stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class FoldingQueue:
    """Folds run one at a time, in order, on a background thread; at most ``depth`` pending.

    Args:
        depth: Folds that may wait or run at once (>= 1).
    """

    def __init__(self, depth: int) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"fold_queue_depth must be an int >= 1 to fold in the background; got {depth!r}")
        self.depth = depth
        self._slots = threading.BoundedSemaphore(depth)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tslightning-folding")
        self._pending: list[Future] = []
        self._stream: torch.cuda.Stream | None = None  # made on the first fold on a CUDA machine
        self.folded = 0
        """Folds run so far (all of them, whether they raised or not)."""

    def submit(self, fold: Callable[[], None]) -> None:
        """Queue ``fold`` behind every earlier one; blocks while ``depth`` folds are pending.

        Raises:
            Exception: what an earlier fold raised (the queue is drained first, so none is lost).
        """
        self._raise_failed()
        self._pending = [f for f in self._pending if not f.done()]
        event = None
        if torch.cuda.is_available():
            self._stream = self._stream or torch.cuda.Stream()
            event = torch.cuda.Event()
            event.record()  # on the learner's current stream, after the backward that produced the gradient
        self._slots.acquire()
        future = self._executor.submit(self._run, fold, event)
        future.add_done_callback(lambda _: self._slots.release())
        self._pending.append(future)

    def drain(self) -> None:
        """Wait until every queued fold has run.

        Raises:
            Exception: the first error a fold raised since the last drain (later folds still ran).
        """
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]  # waits for each, in order
        failed = next((e for e in errors if e is not None), None)
        if failed is not None:
            raise failed

    def discard(self) -> None:
        """Wait until every queued fold has run, dropping their errors (the statistics are being reset)."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.exception()

    def close(self) -> None:
        """Drain, then stop the thread."""
        try:
            self.drain()
        finally:
            self._executor.shutdown(wait=True)

    def _run(self, fold: Callable[[], None], event) -> None:
        try:
            if self._stream is None:
                fold()
                return
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(event)
                fold()
                self._stream.synchronize()  # the gradient may be freed once this returns
        finally:
            self.folded += 1

    def _raise_failed(self) -> None:
        if any(f.done() and f.exception() is not None for f in self._pending):
            self.drain()
