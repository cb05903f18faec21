"""Environment set-up and tear-down off the event loop: attempts open and close their environments on threads.

Opening an attempt's environment (its directory, the image's private copies, the live sandbox) and closing it
(ending the sandbox, removing the copies) are seconds of blocking file and process work. Done on the agent loop's
event-loop thread, they would run one after the other and stall every other attempt's turns (generation requests,
tool calls) meanwhile. :class:`EnvironmentSetup` runs them on a small pool of their own threads instead, so the
attempts of an update set up and close in parallel, at most :func:`setup_threads` at once, while the others go on.

The guarantees are those of the synchronous path: an environment opened for an attempt that was cancelled meanwhile
is closed once it is open, a close that was started completes even when its attempt is cancelled, and nothing is
left open when a set-up fails.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager

from tslightning.rollout.core_placement import place_this_thread
from tslightning.rollout.environment_prefetch import PreparedEnvironment, close_prepared, open_prepared

MAX_SETUP_THREADS = 8
"""Most environments set up or closed at once: set-up is file copying and process starts, which more threads than
the rollout has cores (or than the disk serves) only slow each other down."""


def setup_threads(cpus: Sequence[int] | None) -> int:
    """Threads that set up and close environments at once: one per core of the rollout (``cpus``, else this
    process's), at least 2 (one waiting on a process start while another copies), at most
    :data:`MAX_SETUP_THREADS`."""
    cores = len(cpus) if cpus is not None else len(os.sched_getaffinity(0))
    return max(2, min(MAX_SETUP_THREADS, cores))


class EnvironmentSetup:
    """Opens and closes attempt environments on threads (see the module docstring).

    Args:
        attempt_factory: The rollout's attempt factory (task → context manager of a fresh attempt).
        cpus: Cores the threads (and the processes they start) run on; ``None``: anywhere.
    """

    def __init__(
        self, attempt_factory: Callable[[object], AbstractContextManager], cpus: Sequence[int] | None = None
    ) -> None:
        self.attempt_factory = attempt_factory
        self.cpus = None if cpus is None else list(cpus)
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    async def open(self, task) -> PreparedEnvironment:
        """A fresh environment of ``task``, opened on a set-up thread; the caller closes it with :meth:`close`.

        Raises:
            Exception: what the attempt factory raised (nothing is left open).
        """
        return await wait_for_prepared(self._threads().submit(open_prepared, self.attempt_factory, task))

    async def close(self, prepared: PreparedEnvironment) -> None:
        """Close ``prepared`` on a set-up thread. A cancelled caller stops waiting, the close itself completes.

        Raises:
            Exception: what closing raised (e.g. a directory that could not be removed).
        """
        await asyncio.shield(asyncio.wrap_future(self._threads().submit(prepared.exit_stack.close)))

    def shutdown(self) -> None:
        """Wait for the set-ups and closes under way and stop the threads (a later :meth:`open` starts new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def _threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    setup_threads(self.cpus),
                    thread_name_prefix="tslightning-setup",
                    initializer=None if self.cpus is None else place_this_thread,
                    initargs=() if self.cpus is None else (self.cpus,),
                )
            return self._pool


async def wait_for_prepared(future: Future[PreparedEnvironment]) -> PreparedEnvironment:
    """The environment ``future`` opens on another thread. When the waiting attempt is cancelled, the set-up still
    finishes and its environment is then closed: never left open, never interrupted half-way.

    Raises:
        Exception: what the set-up raised.
    """
    try:
        return await asyncio.shield(asyncio.wrap_future(future))
    except BaseException:
        future.add_done_callback(close_prepared)  # a failed set-up left nothing: close_prepared then does nothing
        raise
