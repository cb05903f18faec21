"""The event loop that runs concurrent agent attempts, with a thread for every attempt's blocking tool call.

Attempts are coroutines, but a tool call (a sandboxed command, a test run, a simulated tool's sleep) is a blocking
function the agent loop hands to ``asyncio.to_thread``. That runs on the loop's default executor, whose size is
``min(32, cpu_count + 4)`` — 6 threads on a 2-core machine — so with more attempts in flight their tool calls would
queue for threads: tool latency would serialize and trajectories would become ready in the executor's order, not
their own. :func:`run_with_tool_threads` gives the loop an executor with one thread per attempt in flight, and can
place the loop's thread and its tool threads on the rollout's cores, away from a learner in the same process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tslightning.rollout.core_placement import place_this_thread

T = TypeVar("T")

SPARE_THREADS = 2
"""Threads beyond one per attempt: the producer's own blocking waits (e.g. a capacity semaphore)."""


def run_with_tool_threads(
    coroutine: Coroutine[Any, Any, T], max_concurrent_attempts: int, cpus: Sequence[int] | None = None
) -> T:
    """``asyncio.run(coroutine)`` with a default executor of ``max_concurrent_attempts + SPARE_THREADS`` threads.

    Args:
        coroutine: The attempts' coroutine, run on the calling thread.
        max_concurrent_attempts: Attempts in flight at once (each may block one thread in a tool call).
        cpus: Cores for the calling thread and the tool threads (the agent loop's tokenization, prompt building
            and engine calls run there); ``None`` leaves placement alone.

    Raises:
        ValueError: if ``max_concurrent_attempts`` is not >= 1 or ``cpus`` is empty (the coroutine is closed).
    """
    if max_concurrent_attempts < 1 or (cpus is not None and not cpus):
        coroutine.close()
        raise ValueError(
            f"max_concurrent_attempts must be >= 1 and cpus None or non-empty; got {max_concurrent_attempts}, {cpus}"
        )
    if cpus is not None:
        place_this_thread(cpus)

    async def main() -> T:
        executor = ThreadPoolExecutor(
            max_concurrent_attempts + SPARE_THREADS,
            thread_name_prefix="tslightning-tool",
            initializer=None if cpus is None else place_this_thread,
            initargs=() if cpus is None else (cpus,),
        )
        asyncio.get_running_loop().set_default_executor(executor)  # asyncio.run shuts it down on exit
        return await coroutine

    return asyncio.run(main())
