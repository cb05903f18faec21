"""Hearing a failed or dead learner rank within seconds, whatever collective the others are blocked in.

The barrier's agreement (:mod:`tslightning.distributed.rank_failure`) reports a rank's failure to ranks that reach
it. A rank can instead be stuck in a *data* collective the failed rank will never enter — an FSDP2 / ZeRO-3 gather
mid-pass, a sharded-statistics exchange — or in a host wait on an NCCL kernel that waits for it. NCCL never fails
such a wait on its own: only its watchdog, after the process group's timeout (30 minutes by default), then aborts
the process. The watch closes that gap with a side channel, the rendezvous store every rank already shares:

* **Failures are posted.** A rank whose local work raised (an out-of-memory error included) posts it before it
  enters the agreement (:meth:`FailureWatch.post`).
* **Deaths are noticed.** Every rank's watch thread bumps a heartbeat counter every ``poll_s``; a peer whose counter
  stops for ``heartbeat_timeout_s`` (killed, crashed, out of host memory) — or a store that stops answering (rank 0,
  which hosts it, died) — is heard as dead.
* **Blocked ranks are freed.** Once a failure or death is heard, a rank that has not completed an agreement within
  ``grace_s`` is presumed blocked: its watch aborts its data process group (NCCL: ``ProcessGroup.abort``), so the
  blocked collective raises, the rank reaches the agreement over the gloo control group and raises
  :class:`~tslightning.distributed.rank_failure.RankFailureError` naming the rank that failed.

A gloo data group cannot be aborted (gloo ignores ``abort``): on a CPU learner a rank blocked inside a gloo data
collective waits for the group's timeout (``learner.timeout_s``); a dead peer's closed connection ends that wait at
once. Control messages travel on their own gloo group with their own, longer timeout (``learner.control_timeout_s``:
they include waits for other ranks' rollouts), so ``learner.timeout_s`` bounds data collectives only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

_PREFIX = "tslightning/failure_watch/"
_DIED = "died:"
_watches: dict[int, FailureWatch] = {}


class FailureWatch:
    """One rank's side channel to the others (see the module docstring); start it on every rank at the same point.

    Args:
        store: The store every rank shares (the default process group's rendezvous store).
        rank: This rank.
        world_size: Learner ranks.
        poll_s: Seconds between heartbeats and between reads of the others' state.
        heartbeat_timeout_s: Seconds without a peer's heartbeat before it is heard as dead.
        grace_s: Seconds a rank may take to reach its agreement after a failure was heard before its data group is
            aborted.
        abort: Aborts this rank's data collectives (default: :func:`abort_data_groups`).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        poll_s: float = 0.5,
        heartbeat_timeout_s: float = 20.0,
        grace_s: float = 2.0,
        abort: Callable[[], bool] | None = None,
    ) -> None:
        self.store = dist.PrefixStore(_PREFIX, store)
        self.rank, self.world_size = rank, world_size
        self.poll_s, self.heartbeat_timeout_s, self.grace_s = poll_s, heartbeat_timeout_s, grace_s
        self.abort = abort or abort_data_groups
        self.heard: dict[int, str] = {}
        """Rank → what was heard of it (its posted failure, or that it died); read by the agreement's errors."""
        self.aborted = False
        self._heard_at: float | None = None
        self._agreed_at = time.monotonic()
        self._beats: dict[int, tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tslightning-failure-watch", daemon=True)

    def start(self) -> FailureWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching (training ended: the ranks leave in any order from here, and none is heard as dead)."""
        try:
            self.store.set(f"left/{self.rank}", "1")
        except (RuntimeError, dist.DistError):
            pass
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.poll_s)

    def post(self, label: str, error: BaseException) -> None:
        """This rank's local work of ``label`` failed: tell every other rank's watch (before the agreement)."""
        message = f"{label}: {type(error).__name__}: {error}"[:2000]
        try:
            self.store.set(f"failed/{self.rank}", message)
            self.store.add("failures", 1)
        except (RuntimeError, dist.DistError):  # the store is gone with rank 0: the agreement will tell
            pass
        self._hear(self.rank, message)

    def agreed(self) -> None:
        """The main thread completed an agreement: it is not blocked (its data group needs no abort)."""
        self._agreed_at = time.monotonic()

    def failures(self) -> dict[int, str]:
        """What has been heard so far, rank → description."""
        with self._lock:
            return dict(self.heard)

    def dead(self) -> dict[int, str]:
        """The ranks heard dead (not those that posted a failure: they still join the agreement)."""
        with self._lock:
            return {rank: message for rank, message in self.heard.items() if message.startswith(_DIED)}

    # ----------------------------------------------------------------- the watch thread
    def _run(self) -> None:
        failures_seen = 0
        while not self._stop.wait(self.poll_s):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                failures_seen = self._read_failures(failures_seen)
                self._read_heartbeats()
            except (RuntimeError, dist.DistError) as error:  # the store's host, rank 0, is gone
                if self._stop.is_set():
                    return
                self._hear(0, f"{_DIED} the rendezvous store it hosts stopped answering ({error})")
            self._abort_if_blocked()

    def _read_failures(self, seen: int) -> int:
        count = self.store.add("failures", 0)
        if count > seen:
            for rank in range(self.world_size):
                if rank != self.rank and rank not in self.heard and self.store.check([f"failed/{rank}"]):
                    self._hear(rank, self.store.get(f"failed/{rank}").decode())
        return count

    def _read_heartbeats(self) -> None:
        now = time.monotonic()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            beat = self.store.add(f"beat/{rank}", 0)
            last, since = self._beats.get(rank, (-1, now))
            if beat == last and now - since > self.heartbeat_timeout_s and self.store.check([f"left/{rank}"]):
                continue  # it finished training and stopped its watch
            if beat != last:
                self._beats[rank] = (beat, now)
            elif beat > 0 and now - since > self.heartbeat_timeout_s:
                self._hear(rank, f"{_DIED} no heartbeat for {now - since:.0f} s (heartbeat_timeout_s)")

    def _hear(self, rank: int, message: str) -> None:
        with self._lock:
            if rank not in self.heard:
                self.heard[rank] = message
                self._heard_at = self._heard_at or time.monotonic()

    def _abort_if_blocked(self) -> None:
        heard_at = self._heard_at
        if heard_at is None or self.aborted or self._agreed_at > heard_at:
            return
        if time.monotonic() - heard_at >= self.grace_s:
            self.aborted = self.abort()


def abort_data_groups() -> bool:
    """Abort this rank's data process group when it can be aborted (not gloo); returns whether it was.

    Every collective blocked on it, and every later one, raises: the rank then reports at its agreement (over the
    gloo control group, which stays). Used only once a peer failed or died: the update cannot complete anyway.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    group = dist.distributed_c10d._get_default_group()
    if dist.get_backend(group) == dist.Backend.GLOO:
        return False
    try:
        group.abort()
    except (AttributeError, RuntimeError):
        try:
            group._get_backend(torch.device("cuda")).abort()
        except (AttributeError, RuntimeError):
            return False
    return True


def start_watch(heartbeat_timeout_s: float = 20.0, poll_s: float = 0.5, grace_s: float = 2.0) -> FailureWatch | None:
    """Start this rank's :class:`FailureWatch` (every rank, right after the process group exists); ``None`` on one
    process. A second call returns the running watch."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if key not in _watches:
        store = dist.distributed_c10d._get_default_store()
        watch = FailureWatch(store, dist.get_rank(), dist.get_world_size(), poll_s, heartbeat_timeout_s, grace_s)
        _watches[key] = watch.start()
    return _watches[key]


def current_watch() -> FailureWatch | None:
    """The watch of the current default process group, if one was started."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return _watches.get(id(dist.distributed_c10d._get_default_group()))


def stop_watch() -> None:
    """Stop the current group's watch (training ended); a no-op without one."""
    if dist.is_available() and dist.is_initialized():
        watch = _watches.pop(id(dist.distributed_c10d._get_default_group()), None)
        if watch is not None:
            watch.close()
