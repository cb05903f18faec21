"""A learner rank that fails mid-update fails the update on every rank, before any parameter changes (Eq. 3).

Each rank does its local work of update k (ingest, sync-schedule learner work) on its own; the barrier's first
collective is an *agreement*: an all-reduce of one status flag per rank. A rank whose local work raised reports
failure there (:func:`reported_to_ranks`), every rank sees it and raises :class:`RankFailureError` before the
direction is reduced, written or stepped — so no rank takes a partial step. A rank that failed first posts its
failure on the :mod:`~tslightning.distributed.failure_watch` side channel, whose watch also notices a rank that
died: a rank blocked in a data collective the failed rank will never enter has that collective aborted (NCCL) and
reaches the agreement within seconds. A rank that hangs while alive fails the collective after the control group's
timeout (``learner.control_timeout_s``), and that failure becomes the same error, naming the update. On a single
process all of this is a no-op and the original exception passes through unchanged. The agreement is a control
message (:mod:`tslightning.distributed.collectives`): a gloo group carries it whatever the data backend.

Ranks that serve learner work in lock-step (sharded parameters, :mod:`tslightning.distributed.lockstep`) exchange a
status word per tick through :func:`exchange_status`, in the agreement's own layout (one float64 slot per rank, ``> 0``
meaning failed; tick codes are negative), so a rank that fails while its peers are ticking is heard at their next tick.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tslightning.distributed.collectives import CollectiveFailure, control_all_reduce, control_timeout, distributed
from tslightning.distributed.failure_watch import current_watch


class RankFailureError(RuntimeError):
    """Update k (or a set-up phase) failed on at least one learner rank; no rank took its optimizer step."""


_NO_STEP = "no rank took the optimizer step"


def agree_to_step(update: int) -> None:
    """The barrier's first collective: every rank confirms its local work of update ``update`` succeeded.

    Raises:
        RankFailureError: if a rank reported failure, or the agreement did not complete within the group's timeout.
    """
    _agree(update, None)


@contextmanager
def reported_to_ranks(update: int) -> Iterator[None]:
    """Run one rank's local work of update ``update``; if it raises, the other ranks learn it at their agreement.

    Raises:
        RankFailureError: (several ranks) chained to the local exception, after the other ranks were told.
    """
    try:
        yield
    except RankFailureError:
        raise
    except Exception as error:
        if not distributed():
            raise
        watch = current_watch()
        if watch is not None and watch.aborted:  # this rank's collective was aborted for another rank's failure
            _agree(update, error, blamed=False)
            raise  # (an abort follows a failure heard elsewhere, which the agreement raised for)
        _post(_label(update), error)
        _agree(update, error)


def exchange_status(update: int, code: int) -> list[int]:
    """One lock-step tick's status exchange: every rank's ``code`` (``>= 1``), in rank order.

    Shares :func:`_agree`'s collective (an all-reduce of one float64 slot per rank), so it pairs with the agreement
    of a rank that failed: that rank's slot is positive, and this raises as the agreement would.

    Raises:
        ValueError: if ``code`` is not ``>= 1``.
        RankFailureError: if a rank reported failure, or the collective failed (a rank died or hung past the
            process group's timeout).
    """
    if code < 1:
        raise ValueError(f"a tick status code is >= 1; got {code}")
    if not distributed():
        return [code]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    slots = torch.zeros(world_size, dtype=torch.float64)
    slots[rank] = -float(code)
    _all_reduce(slots, update, rank, None)
    _raise_if_failed(slots, update, world_size, None)
    return [int(-v) for v in slots.tolist()]


@contextmanager
def agreed_by_ranks(phase: str) -> Iterator[None]:
    """Run one set-up phase (``phase`` names it) on this rank, then agree with every rank that it succeeded.

    Unlike an update's local work, a set-up phase has no barrier after it to report at, so every rank agrees here,
    success or not: a rank that raised fails the phase on every rank at once, and a rank that died or hangs fails it
    after the process group's timeout (``learner.timeout_s``) — no rank is left waiting at a later collective.

    Raises:
        RankFailureError: if any rank failed, died or hung (several ranks); the local exception on one process.
    """
    error = None
    try:
        yield
    except Exception as raised:
        if not distributed():
            raise
        error = raised
        _post(phase, error)
    _agree(phase, error, consequence="training did not start")
    if error is not None:  # _agree raised for it already; kept for type checkers
        raise error


def _agree(update: int | str, error: Exception | None, consequence: str = _NO_STEP, blamed: bool = True) -> None:
    """The agreement itself; ``blamed=False``: ``error`` is the consequence of another rank's failure (an aborted
    collective), so this rank reports success and raises for the ranks that failed."""
    if not distributed():
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flags = torch.zeros(world_size, dtype=torch.float64)
    flags[rank] = 1.0 if error is not None and blamed else 0.0
    _all_reduce(flags, update, rank, error, consequence)
    _raise_if_failed(flags, update, world_size, error, consequence)


def _label(update: int | str) -> str:
    return f"update {update}" if isinstance(update, int) else update


def _post(label: str, error: BaseException) -> None:
    """Tell the other ranks' watches at once: one of them may be blocked where the agreement cannot reach it."""
    watch = current_watch()
    if watch is not None:
        watch.post(label, error)


def _heard() -> str:
    """What this rank's watch heard of the others, for an error message ('' without a watch or news)."""
    watch = current_watch()
    heard = watch.failures() if watch is not None else {}
    heard.pop(watch.rank if watch is not None else -1, None)  # this rank's own error is shown as such
    return "".join(f"; rank {rank}: {message}" for rank, message in sorted(heard.items()))


def _all_reduce(
    flags: torch.Tensor, update: int | str, rank: int, error: Exception | None, consequence: str = _NO_STEP
) -> None:
    try:
        control_all_reduce(flags)
    except CollectiveFailure as collective_error:  # timeouts and a peer's closed connection; other errors pass
        raise RankFailureError(
            f"{_label(update)}: rank {rank} waited for every learner rank and the collective failed (control "
            f"timeout {control_timeout()}): a rank died or hung; {consequence} on this rank{_heard()}. A rank that "
            "hangs while alive is bounded by fit's learner.control_timeout_s"
        ) from (error or collective_error)
    watch = current_watch()
    if watch is not None:
        watch.agreed()


def _raise_if_failed(
    flags: torch.Tensor, update: int | str, world_size: int, error: Exception | None, consequence: str = _NO_STEP
) -> None:
    failed = [r for r in range(world_size) if flags[r] > 0]  # negative slots: ranks still ticking (lock-step)
    if failed:
        own = f"; here: {type(error).__name__}: {error}" if error is not None else ""
        heard = _heard()
        raise RankFailureError(
            f"{_label(update)} failed on learner rank(s) {failed} of {world_size}; {consequence} (parameters unchanged "
            f"everywhere){own}{heard}"
        ) from error
