"""Lock-step learner ticks, so streaming ranks can share sharded parameters (DeepSpeed ZeRO-3, FSDP2).

ZeRO-3 partitions every parameter across the learner ranks and all-gathers each layer's parameters in every
forward and backward: a collective that all ranks must enter together, in the same order. Streaming ranks serve
different numbers of sources, each when its own source becomes ready, so their gathers would never pair up. Under a
sharded strategy the module therefore queues its learner work and serves it in *ticks*:

1. every rank exchanges a status code (one all-reduce of one slot per rank: has queued work? reached the barrier?);
2. if any rank has queued work, every rank runs exactly one policy pass — its next queued unit, or, when it has
   none, an *idle pass*: a forward and backward over two tokens whose gradient is discarded — so every rank runs
   the same sequence of per-layer gathers.

Ranks tick whenever they ingest a stream item (and on until their own queue is empty) and *drain* at the barrier:
they tick until no rank holds work and every rank has reached the barrier, which all ranks observe at the same
tick, so they leave the drain together. Idle passes change nothing (their gradient is never folded), so the
update stays exact; they are the price of sharding: a rank with less work than its peers waits for them tick by
tick instead of finishing early. The status exchange shares the barrier agreement's layout
(:func:`tslightning.distributed.rank_failure.exchange_status`): a rank whose local work fails is heard at its peers'
next tick.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tslightning.distributed.rank_failure import exchange_status

_HAS_WORK = 1
_DRAINING = 2


@dataclass(frozen=True)
class TickStatus:
    """What one tick's exchange showed, the same on every rank."""

    any_work: bool
    """Some rank held queued work: every rank ran one pass this tick."""
    all_draining: bool
    """Every rank had reached the barrier."""


class LockstepTicks:
    """Queued learner work of one rank, served one policy pass per tick in step with the other ranks.

    Args:
        idle_pass: One policy pass whose result is discarded, with the same collectives as a unit of real work
            (one forward and one backward of the whole policy).
    """

    def __init__(self, idle_pass: Callable[[], None]) -> None:
        self._idle_pass = idle_pass
        self._queue: deque[Callable[[], None]] = deque()
        self.ticks = 0
        """Ticks with a pass (one object serves one update)."""
        self.idle_passes = 0
        """Idle passes this rank ran (its lock-step overhead)."""

    def submit(self, work: Callable[[], None]) -> None:
        """Queue one unit of work: exactly one forward and one backward of the policy."""
        self._queue.append(work)

    def tick(self, update: int, draining: bool = False) -> TickStatus:
        """Exchange status with every rank, then run one pass if any rank has work (a collective)."""
        code = 1 + (_HAS_WORK if self._queue else 0) + (_DRAINING if draining else 0)
        codes = [c - 1 for c in exchange_status(update, code)]
        status = TickStatus(any(c & _HAS_WORK for c in codes), all(c & _DRAINING for c in codes))
        if status.any_work:
            self.ticks += 1
            if self._queue:
                self._queue.popleft()()
            else:
                self.idle_passes += 1
                self._idle_pass()
        return status

    def serve(self, update: int) -> None:
        """After an ingest: one tick, then more while this rank still holds work (a collective)."""
        self.tick(update)
        self.flush(update)

    def flush(self, update: int) -> None:
        """Tick until this rank's queued work has all run (a collective; nothing when none is queued): before
        something that needs it done, such as closing a group whose sources' folds are queued."""
        while self._queue:
            self.tick(update)

    def drain(self, update: int) -> None:
        """At the barrier: tick until no rank holds work and every rank has arrived (a collective)."""
        while True:
            status = self.tick(update, draining=True)
            if not status.any_work and status.all_draining:
                return
