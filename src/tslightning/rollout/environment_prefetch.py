"""Environment prefetch: update k+1's attempt environments, set up while update k's turns, tail and barrier run.

An attempt's environment (its directory, private copies of the image's writable directories, the live sandbox and
the image's start-up command) depends on the task alone, never on the policy, and update k+1's tasks are fixed by the
data order before θ_{k+1} exists. So when update k's last attempt has opened its environment (the set-up threads have
nothing left to do for update k), the rollout DataModule asks :class:`EnvironmentPrefetch` to open the first
``capacity`` attempts of update k+1, in the order they will start, on a small thread pool, while update k's turns,
tool calls, verifiers, the learner's tail, the barrier and the publication run. Each attempt of update k+1 then takes
a prepared environment of its task, if there is one, instead of opening a fresh one; it is the same object the
attempt factory would have returned, opened the same way, only earlier. Nothing else is done early: no agent command
runs in it, no sampling seed or task choice moves.

Bounds and cleanup: at most ``capacity`` environments are prepared at a time; :meth:`EnvironmentPrefetch.discard`
closes every environment an update did not take (more prepared than its attempts, a failed rollout) and
:meth:`EnvironmentPrefetch.close` (the run's end, an error, Ctrl-C) cancels what has not started and closes the rest.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass

from tslightning.rollout.core_placement import place_this_thread

SETUP_THREADS = 2
"""Threads that open prepared environments at once (set-up is copying and process starts: I/O-bound)."""


@dataclass
class PreparedEnvironment:
    """An opened attempt environment: ``attempt`` (what the factory's context manager entered) and the stack that
    closes it.

    Attributes:
        attempt: The entered attempt.
        exit_stack: Closes the attempt (its sandbox, its directory).
        setup_s: Seconds its set-up took on its set-up thread.
    """

    attempt: object
    exit_stack: ExitStack
    setup_s: float


class EnvironmentPrefetch:
    """Opens one update's first attempt environments ahead of the update (see the module docstring).

    Args:
        attempt_factory: The rollout's attempt factory (task → context manager of a fresh attempt).
        capacity: Most environments prepared at once (>= 1).
        cpus: Cores the set-up threads (and the processes they start) run on, e.g. the rollout's; ``None``: anywhere.

    Raises:
        ValueError: ``capacity`` is below 1.
    """

    def __init__(
        self,
        attempt_factory: Callable[[object], AbstractContextManager],
        capacity: int,
        cpus: Sequence[int] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"rollout.prefetch_environments must be >= 1 to prefetch (0 turns it off); got {capacity}")
        self.attempt_factory = attempt_factory
        self.capacity = capacity
        self._pool = ThreadPoolExecutor(
            min(capacity, SETUP_THREADS),
            thread_name_prefix="tslightning-prefetch",
            initializer=None if cpus is None else place_this_thread,
            initargs=() if cpus is None else (list(cpus),),
        )
        self._lock = threading.Lock()
        self._update: int | None = None
        self._waiting: dict[str, deque[Future[PreparedEnvironment]]] = {}
        self._closed = False
        self.prepared = 0
        """Environments opened ahead, over the run."""
        self.taken = 0
        """Prepared environments an attempt used."""
        self.discarded = 0
        """Prepared environments closed unused (or cancelled before they were opened)."""

    def prepare(self, update: int, tasks: Sequence[object]) -> None:
        """Open environments for ``update``'s attempts, one per entry of ``tasks`` (each has a ``task_id``) in the
        order the attempts start, up to ``capacity``; whatever an earlier update left is closed first."""
        self.discard()
        with self._lock:
            if self._closed:
                return
            self._update = update
            for task in tasks[: self.capacity]:
                future = self._pool.submit(self._open, task)
                self._waiting.setdefault(task.task_id, deque()).append(future)

    def take(self, update: int, task) -> Future[PreparedEnvironment] | None:
        """A prepared (or still opening) environment of ``task`` for ``update``, now the caller's to close; ``None``
        when none was prepared (the attempt opens a fresh one)."""
        with self._lock:
            queue = self._waiting.get(task.task_id) if update == self._update else None
            if not queue:
                return None
            self.taken += 1
            return queue.popleft()

    def discard(self) -> None:
        """Close every prepared environment no attempt took (cancelling those not yet opening). Idempotent."""
        with self._lock:
            futures = [future for queue in self._waiting.values() for future in queue]
            self._waiting, self._update = {}, None
        self.discarded += len(futures)
        opening = [future for future in futures if not future.cancel()]  # cancel all first: none starts meanwhile
        for future in opening:
            close_prepared(future)

    def close(self) -> None:
        """Discard everything and stop the set-up threads (the run's end); later calls to :meth:`prepare` do
        nothing."""
        with self._lock:
            self._closed = True
        self.discard()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _open(self, task) -> PreparedEnvironment:
        prepared = open_prepared(self.attempt_factory, task)
        with self._lock:
            self.prepared += 1
        return prepared


def open_prepared(attempt_factory: Callable[[object], AbstractContextManager], task) -> PreparedEnvironment:
    """Open a fresh environment of ``task`` on the calling thread (a failed set-up leaves nothing open)."""
    start = time.perf_counter()
    stack = ExitStack()
    try:
        attempt = stack.enter_context(attempt_factory(task))
    except BaseException:
        stack.close()
        raise
    return PreparedEnvironment(attempt, stack, time.perf_counter() - start)


def close_prepared(future: Future[PreparedEnvironment]) -> None:
    """Close the environment ``future`` opens, once it is open (one that failed to open left nothing to close)."""
    try:
        prepared = future.result()
    except (Exception, CancelledError):
        return
    prepared.exit_stack.close()
