"""A learner rank that fails mid-update fails the update on every rank, before any parameter changes (Eq. 3).

Each rank does its local work of update k (ingest, sync-schedule learner work) on its own; the barrier's first
collective is an *agreement*: an all-reduce of one status flag per rank. A rank whose local work raised reports
failure there (:func:`reported_to_ranks`), every rank sees it and raises :class:`RankFailureError` before the
direction is reduced, written or stepped — so no rank takes a partial step. A rank that died or hangs never
reaches the agreement: the collective then fails after the process group's timeout (Fabric's
``DDPStrategy(timeout=...)``, default 30 min) and that failure becomes the same error, naming the update and the
timeout. On a single process both are no-ops and the original exception passes through unchanged. The agreement is
a control message (:mod:`tslightning.distributed.collectives`): a gloo group carries it whatever the data backend.

Ranks that serve learner work in lock-step (sharded parameters, :mod:`tslightning.distributed.lockstep`) exchange a
status word per tick through :func:`exchange_status`, in the agreement's own layout (one float64 slot per rank, ``> 0``
meaning failed; tick codes are negative), so a rank that fails while its peers are ticking is heard at their next tick.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from tslightning.distributed.collectives import CollectiveFailure, control_all_reduce, distributed, group_timeout


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
    _agree(phase, error, consequence="training did not start")
    if error is not None:  # _agree raised for it already; kept for type checkers
        raise error


def _agree(update: int | str, error: Exception | None, consequence: str = _NO_STEP) -> None:
    if not distributed():
        return
    rank, world_size = dist.get_rank(), dist.get_world_size()
    flags = torch.zeros(world_size, dtype=torch.float64)
    flags[rank] = 0.0 if error is None else 1.0
    _all_reduce(flags, update, rank, error, consequence)
    _raise_if_failed(flags, update, world_size, error, consequence)


def _label(update: int | str) -> str:
    return f"update {update}" if isinstance(update, int) else update


def _all_reduce(
    flags: torch.Tensor, update: int | str, rank: int, error: Exception | None, consequence: str = _NO_STEP
) -> None:
    try:
        control_all_reduce(flags)
    except CollectiveFailure as collective_error:  # timeouts and a peer's closed connection; other errors pass
        timeout = group_timeout()
        raise RankFailureError(
            f"{_label(update)}: rank {rank} waited for every learner rank and the collective failed (process group "
            f"timeout {timeout}): a rank died or hung; {consequence} on this rank. Set the strategy's timeout "
            "(fit: learner.timeout_s) to bound the wait"
        ) from (error or collective_error)


def _raise_if_failed(
    flags: torch.Tensor, update: int | str, world_size: int, error: Exception | None, consequence: str = _NO_STEP
) -> None:
    failed = [r for r in range(world_size) if flags[r] > 0]  # negative slots: ranks still ticking (lock-step)
    if failed:
        own = f"; here: {type(error).__name__}: {error}" if error is not None else ""
        raise RankFailureError(
            f"{_label(update)} failed on learner rank(s) {failed} of {world_size}; {consequence} (parameters unchanged "
            f"everywhere){own}"
        ) from error
