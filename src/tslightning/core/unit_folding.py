"""Folding one gradient unit into the statistics: Eq. 7's two axpys (or Eq. 9's one) on the unit's values.

A fold is a list of *pieces* ``(statistic view, gradient values, alpha)``: ``view += alpha · values`` for each. The
learner thread folds a unit the moment the backward hands it over
(:class:`~tslightning.core.unit_backward.UnitBackward`), or queues it on the folding thread
(:class:`~tslightning.core.folding_queue.FoldingQueue`, ``learner.fold_queue_depth`` units in flight at most).

Statistics on the host, gradients on an accelerator (the host fallback of ``learner.statistics_device``): each
queued unit is first copied into one of ``depth`` page-locked *staging buffers* without blocking the learner (an
event recorded after the copies), and the folding thread waits for that event, adds from the staging buffer in host
memory and hands the buffer back. The learner only waits when every buffer is still being folded — never for a
whole-gradient copy: at most one unit crosses the bus at a time per buffer, overlapped with the next unit's backward.

Exactness: the same additions in the same order as folding inline (one thread folds, in submission order), so the
statistics are bitwise those of the inline fold.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any

import torch

from tslightning.core.folding_queue import FoldingQueue

Piece = tuple[torch.Tensor, torch.Tensor, float]
"""``(statistic view, gradient values, alpha)``: the fold adds ``alpha · values`` (reshaped) into the view."""


class UnitFolder:
    """Folds units now (``queue`` ``None``) or on the folding thread, staged through page-locked buffers when the
    gradients must cross to host statistics.

    Args:
        folding: The folding thread, or ``None`` to fold on the caller's thread.
        staging_numel: Values of the largest unit (each staging buffer's size).
    """

    def __init__(self, folding: FoldingQueue | None, staging_numel: int) -> None:
        self.queue = folding
        self.staging_numel = staging_numel
        self._buffers: queue.SimpleQueue | None = None  # made at the first staged fold
        self.staged_units = 0
        """Units copied through a staging buffer (host statistics of accelerator gradients)."""

    def fold(self, pieces: Sequence[Piece]) -> None:
        """Add every piece (see the module docstring); queued folds keep their values until they ran.

        Raises:
            Exception: a queued fold's error, at the next fold or drain.
        """
        if not pieces:
            return
        if self.queue is None:
            _apply(pieces)
            return
        if not _crosses_to_host(pieces):
            self.queue.submit(lambda: _apply(pieces))
            return
        buffer, staged, event = self._stage(pieces)
        self.staged_units += 1

        def fold_staged() -> None:
            try:
                event.synchronize()  # the unit's copies into the staging buffer have landed
                _apply(staged)
            finally:
                self._buffers.put(buffer)

        self.queue.submit(fold_staged)

    def drain(self) -> None:
        """Wait for every queued fold (the statistics are then complete); raises a fold's error."""
        if self.queue is not None:
            self.queue.drain()

    def discard(self) -> None:
        """Wait for every queued fold, dropping errors (the statistics are being reset)."""
        if self.queue is not None:
            self.queue.discard()

    def _stage(self, pieces: Sequence[Piece]) -> tuple[torch.Tensor, list[Piece], Any]:
        """Copy each distinct source tensor into a free page-locked buffer, without blocking (the buffer is taken
        from the pool; waits only while all ``depth`` buffers are in flight)."""
        if self._buffers is None:
            self._buffers = queue.SimpleQueue()
            dtype = pieces[0][0].dtype  # the statistics' dtype: the copy converts on the way
            for _ in range(self.queue.depth):
                self._buffers.put(torch.empty(self.staging_numel, dtype=dtype, pin_memory=torch.cuda.is_available()))
        buffer = self._buffers.get()
        copies: dict[int, torch.Tensor] = {}
        offset = 0
        staged = []
        for view, values, alpha in pieces:
            if id(values) not in copies:
                host = buffer[offset : offset + values.numel()]
                host.copy_(values.detach().reshape(-1), non_blocking=True)
                copies[id(values)] = host
                offset += values.numel()
            staged.append((view, copies[id(values)], alpha))
        event = torch.cuda.Event() if torch.cuda.is_available() else _Landed()
        event.record()  # on the learner's stream, after the copies
        return buffer, staged, event


class _Landed:
    """The event of a host-to-host staging copy (no accelerator): it has landed when it returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _apply(pieces: Sequence[Piece]) -> None:
    for view, values, alpha in pieces:
        view.add_(values.detach().reshape(-1).to(device=view.device, dtype=view.dtype), alpha=alpha)


def _crosses_to_host(pieces: Sequence[Piece]) -> bool:
    view, values, _ = pieces[0]
    return view.device.type == "cpu" and values.device.type != "cpu"
