"""Wall-clock readings that include the device's queued work (App. B.1: step and service times are wall times).

CUDA kernels run asynchronously: ``time.perf_counter()`` right after a backward reads the time the kernels were
*queued*, not when they finished, so a phase timed with host timers alone is charged to whichever later phase first
waits for the device. :func:`synchronized_clock` waits for ``device``'s queued work first, then reads the host clock.
On a CPU (or ``None``) it is ``time.perf_counter()`` itself.

The wait is a synchronisation point: call it at phase boundaries (an update's start and end, a source's service
start and end, around publication), never inside a tight loop.
"""

from __future__ import annotations

import time

import torch


def synchronized_clock(device: torch.device | str | None = None) -> float:
    """``time.perf_counter()`` after every kernel queued on ``device`` (a CUDA device; else no wait) has finished.

    Args:
        device: The device whose queued work belongs to the phase being timed; ``None`` or a non-CUDA device: no wait.
    """
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
