"""Folding gradient units: inline, on the folding thread, and through the staging buffers host statistics use — the
same statistics bit for bit."""

from __future__ import annotations

import threading

import torch

from tslightning.core import unit_folding
from tslightning.core.folding_queue import FoldingQueue
from tslightning.core.unit_folding import UnitFolder


def _units(seed: int, count: int = 6) -> list[list[tuple[int, torch.Tensor]]]:
    """Units of (slice start, values) into a 40-value statistic, each with two pieces."""
    generator = torch.Generator().manual_seed(seed)
    return [
        [(0, torch.randn(10, generator=generator)), (20, torch.randn(12, generator=generator))] for _ in range(count)
    ]


def _fold(folder: UnitFolder, units) -> tuple[torch.Tensor, torch.Tensor]:
    g1, g2 = torch.zeros(40), torch.zeros(40)
    for unit in units:
        pieces = []
        for start, values in unit:
            view = slice(start, start + values.numel())
            pieces += [(g1[view], values, 0.37), (g2[view], values, 1.0)]
        folder.fold(pieces)
    folder.drain()
    return g1, g2


def test_queued_and_staged_folds_equal_the_inline_fold_bitwise(monkeypatch):
    units = _units(0)
    inline = _fold(UnitFolder(None, 22), units)
    queued = _fold(UnitFolder(FoldingQueue(2), 22), units)
    monkeypatch.setattr(unit_folding, "_crosses_to_host", lambda pieces: True)  # as gradients on an accelerator
    staging = UnitFolder(FoldingQueue(2), 22)
    staged = _fold(staging, units)
    for a, b, c in zip(inline, queued, staged, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert staging.staged_units == len(units)


def test_staging_waits_only_while_every_buffer_is_in_flight(monkeypatch):
    """With depth 2 the learner runs ahead of a slow fold by two units, then waits for a buffer to come back."""
    monkeypatch.setattr(unit_folding, "_crosses_to_host", lambda pieces: True)
    release = threading.Event()
    folder = UnitFolder(FoldingQueue(2), 22)
    statistic = torch.zeros(40)
    original = unit_folding._apply

    def slow_apply(pieces):
        release.wait(10)
        original(pieces)

    monkeypatch.setattr(unit_folding, "_apply", slow_apply)
    submitted = []

    def learner():
        for start, values in (unit[0] for unit in _units(1, 4)):
            folder.fold([(statistic[start : start + values.numel()], values, 1.0)])
            submitted.append(start)

    thread = threading.Thread(target=learner)
    thread.start()
    thread.join(1.0)
    assert len(submitted) == 2 and thread.is_alive()  # two buffers in flight, the third unit waits for one
    release.set()
    thread.join(10)
    folder.drain()
    assert len(submitted) == 4 and bool(statistic.abs().sum() > 0)
