"""The event loop that runs concurrent agent attempts, with a thread for every attempt's blocking tool call.

Attempts are coroutines, but a tool call (a sandboxed command, a test run, a simulated tool's sleep) is a blocking
function the agent loop hands to ``asyncio.to_thread``. That runs on the loop's default executor, whose size is
``min(32, cpu_count + 4)`` — 6 threads on a 2-core machine — so with more attempts in flight their tool calls would
queue for threads: tool latency would serialize and trajectories would become ready in the executor's order, not
their own. :func:`run_with_tool_threads` gives the loop an executor with one thread per attempt in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

SPARE_THREADS = 2
"""Threads beyond one per attempt: the producer's own blocking waits (e.g. a capacity semaphore)."""


def run_with_tool_threads(coroutine: Coroutine[Any, Any, T], max_concurrent_attempts: int) -> T:
    """``asyncio.run(coroutine)`` with a default executor of ``max_concurrent_attempts + SPARE_THREADS`` threads.

    Raises:
        ValueError: if ``max_concurrent_attempts`` is not >= 1 (the coroutine is closed, never run).
    """
    if max_concurrent_attempts < 1:
        coroutine.close()
        raise ValueError(f"max_concurrent_attempts must be >= 1; got {max_concurrent_attempts}")

    async def main() -> T:
        executor = ThreadPoolExecutor(max_concurrent_attempts + SPARE_THREADS, thread_name_prefix="tslightning-tool")
        asyncio.get_running_loop().set_default_executor(executor)  # asyncio.run shuts it down on exit
        return await coroutine

    return asyncio.run(main())
