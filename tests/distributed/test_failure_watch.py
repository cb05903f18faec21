"""A rank that fails or dies mid-update is heard by the others within seconds, whatever they are blocked in.

Two processes per scenario, each with a data-collective timeout of 60 s and a control timeout of 120 s: every
scenario must end in a few seconds, so only the failure watch (not a timeout) can end it. Rank 1 fails — an injected
out-of-memory error, or a freeze (SIGSTOP: a vanished node whose connections stay open) — while rank 0 is

* blocked in a data collective on the NCCL stand-in (``nccl_standin.py``: like NCCL, such a wait never fails on its
  own; the watch aborts the group), or
* waiting at the barrier's agreement or ticking in lock-step, over gloo.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from datetime import timedelta

import nccl_standin
import pytest
import torch
import torch.distributed as dist

from tslightning.distributed.collectives import control_group
from tslightning.distributed.failure_watch import FailureWatch, start_watch, stop_watch
from tslightning.distributed.rank_failure import agree_to_step, exchange_status, reported_to_ranks

HEARTBEAT_TIMEOUT_S = 3.0
WITHIN_S = 15.0  # every scenario's bound, far below both timeouts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _injected_oom() -> None:
    time.sleep(0.5)
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")


def _freeze() -> None:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGSTOP)


def _data_collective() -> None:
    """Blocks until every rank joins (an object collective: the stand-in lets it through as it would a device one)."""
    dist.all_gather_object([None, None], "data")


def _barrier_wait() -> None:
    pass  # straight to the agreement, where it waits for the other rank


def _ticking() -> None:
    for _ in range(10_000):  # lock-step ticks, as sharded ranks exchange them between passes
        exchange_status(0, 1)
        time.sleep(0.01)


SCENARIOS = {
    # name: (backend, rank 0's work, rank 1's failure)
    "oom-while-blocked-in-a-data-collective": ("nccl_standin", _data_collective, _injected_oom),
    "freeze-while-blocked-in-a-data-collective": ("nccl_standin", _data_collective, _freeze),
    "freeze-while-waiting-at-the-barrier": ("gloo", _barrier_wait, _freeze),
    "oom-while-ticking": ("gloo", _ticking, _injected_oom),
}


def _rank(name: str, rank: int, port: int, results) -> None:
    backend, waits, fails = SCENARIOS[name]
    nccl_standin.register()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    control_group(timedelta(seconds=120))
    start_watch(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S, poll_s=0.2, grace_s=0.5)
    start = time.monotonic()
    try:
        with reported_to_ranks(0):
            (waits if rank == 0 else fails)()
        agree_to_step(0)
        results[rank] = ("no error", time.monotonic() - start)
    except Exception as error:
        results[rank] = (f"{type(error).__name__}: {error}", time.monotonic() - start)
    stop_watch()
    os._exit(0)  # no teardown: the peer may be frozen or gone


@pytest.fixture(scope="module")
def outcomes():
    context = multiprocessing.get_context("forkserver")  # torch imported once, in the server, not per rank
    context.set_forkserver_preload(
        ["torch", "tslightning.distributed.rank_failure", "nccl_standin", "pytest", __name__]
    )
    found = {}
    with context.Manager() as manager:
        for name in SCENARIOS:
            results, port = manager.dict(), _free_port()
            ranks = [context.Process(target=_rank, args=(name, r, port, results)) for r in (0, 1)]
            for process in ranks:
                process.start()
            ranks[0].join(timeout=120)
            if SCENARIOS[name][2] is not _freeze:
                ranks[1].join(timeout=30)
            for process in ranks:
                if process.is_alive():
                    process.kill()  # a frozen rank 1
                process.join(timeout=10)
            found[name] = dict(results)
    return found


def test_an_oom_mid_pass_frees_a_rank_blocked_in_a_data_collective_within_seconds(outcomes):
    """NCCL-like: the failed rank posts its error, the blocked rank's watch aborts its data group, both agree."""
    results = outcomes["oom-while-blocked-in-a-data-collective"]
    for rank in (0, 1):
        error, seconds = results[rank]
        assert error.startswith("RankFailureError: update 0 failed on learner rank(s) [1] of 2"), error
        assert seconds < WITHIN_S
    assert "OutOfMemoryError: CUDA out of memory" in results[0][0]  # rank 0 says what happened on rank 1


def test_a_frozen_rank_is_heard_dead_by_a_rank_blocked_in_a_data_collective(outcomes):
    error, seconds = outcomes["freeze-while-blocked-in-a-data-collective"][0]
    assert error.startswith("RankFailureError: update 0: rank 0 waited for every learner rank"), error
    assert "rank 1: died: no heartbeat" in error
    assert HEARTBEAT_TIMEOUT_S <= seconds < WITHIN_S


def test_a_frozen_rank_fails_the_agreement_within_the_heartbeat_timeout_over_gloo(outcomes):
    error, seconds = outcomes["freeze-while-waiting-at-the-barrier"][0]
    assert error.startswith("RankFailureError: update 0: rank 0 waited for every learner rank"), error
    assert "rank 1: died: no heartbeat" in error
    assert HEARTBEAT_TIMEOUT_S <= seconds < WITHIN_S  # not the 120 s control timeout


def test_an_oom_is_heard_at_the_next_lockstep_tick_over_gloo(outcomes):
    results = outcomes["oom-while-ticking"]
    for rank in (0, 1):
        error, seconds = results[rank]
        assert error.startswith("RankFailureError: update 0 failed on learner rank(s) [1] of 2"), error
        assert seconds < WITHIN_S


def _watches(store, aborted: list, **timing):
    """Rank 0's started watch (its abort recorded) and rank 1's, which the test drives by hand."""
    timing = {"poll_s": 0.05, "heartbeat_timeout_s": 0.5, "grace_s": 0.2} | timing
    watch = FailureWatch(store, 0, 2, abort=lambda: aborted.append(time.monotonic()) or True, **timing)
    return watch.start(), FailureWatch(store, 1, 2, **timing)


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_posted_failure_is_heard_and_a_rank_that_does_not_agree_is_aborted():
    aborted: list = []
    watch, peer = _watches(dist.HashStore(), aborted)
    try:
        peer.post("update 3", torch.OutOfMemoryError("CUDA out of memory (injected)"))
        assert _until(lambda: 1 in watch.failures())
        assert watch.failures()[1] == "update 3: OutOfMemoryError: CUDA out of memory (injected)"
        assert watch.dead() == {}  # a failed rank still joins the agreement
        assert _until(lambda: watch.aborted) and len(aborted) == 1  # no agreement completed within grace_s
    finally:
        watch.close()


def test_a_rank_that_agrees_in_time_keeps_its_data_group():
    aborted: list = []
    watch, peer = _watches(dist.HashStore(), aborted, grace_s=1.0)
    try:
        peer.post("update 0", RuntimeError("boom"))
        assert _until(lambda: 1 in watch.failures())
        watch.agreed()  # the agreement told this rank: it was not blocked
        time.sleep(1.5)
        assert aborted == [] and not watch.aborted
    finally:
        watch.close()


def test_a_silent_peer_is_dead_but_one_that_left_is_not():
    store, aborted = dist.HashStore(), []
    watch, peer = _watches(store, aborted)
    try:
        peer.store.add("beat/1", 1)  # it beat once, then went silent
        assert _until(lambda: 1 in watch.dead())
        assert watch.dead()[1].startswith("died: no heartbeat for")
    finally:
        watch.close()
    watch, peer = _watches(dist.HashStore(), [])
    try:
        peer.store.add("beat/1", 1)
        peer.close()  # finished training: it says so before its heartbeat stops
        time.sleep(1.0)
        assert watch.failures() == {}
    finally:
        watch.close()
