"""What one update logs, the Lightning way: one row per update, on one step axis, under a Trainer and under Fabric.

Under a ``Trainer`` the metrics go through ``pl_module.log_dict(..., on_step=True, on_epoch=False)``, so the Trainer's
logger connector owns them as it owns ``self.log`` in ``training_step``: they reach ``trainer.callback_metrics`` (and
so ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping``), the progress bar when asked, and the loggers on Lightning's
own step axis, every ``log_every_n_steps`` Trainer steps — one Trainer step being one update (see
:mod:`tslightning.callbacks.update_callback`). Values are logged as float64 tensors, so a norm keeps every digit.

Under Fabric there is no logger connector: each call adds to the update's *row*, and the row is written once, with
``fabric.log_dict(row, step=k)``, by :func:`write_update_row` — which the loop calls after the update's
``on_train_batch_end`` (``tslightning fit`` does), or which happens by itself when metrics of the next update arrive
or a tslightning callback sees ``on_train_end``. A CSV logger thus gets exactly one row per update, whichever
callbacks logged into it and in whatever order. Only global rank 0 writes (Fabric's loggers log on rank 0).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch


@dataclass
class _Row:
    """The metrics of update ``step`` collected so far under one Fabric."""

    step: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)


_ROWS: weakref.WeakKeyDictionary[L.Fabric, _Row] = weakref.WeakKeyDictionary()


def log_update_metrics(
    trainer: Any, module: Any, metrics: Mapping[str, float], step: int, prog_bar: Iterable[str] = ()
) -> None:
    """Log ``metrics`` of update ``step`` the way the host logs: see the module docstring.

    Args:
        trainer: The ``Trainer`` or ``Fabric`` running the update (or a stand-in exposing ``global_rank`` and
            ``loggers``, which logs straight away).
        module: The LightningModule being trained (``pl_module`` in a callback hook); its ``log_dict`` is used under
            a Trainer.
        metrics: Name → scalar (a float or a one-element tensor).
        step: k, the update's index (its policy version): the step under Fabric. A Trainer uses its own step.
        prog_bar: Names also shown in a Trainer's progress bar.
    """
    if not metrics:
        return
    values = {name: float(value) for name, value in metrics.items()}
    if isinstance(trainer, L.Trainer):
        shown = set(prog_bar)
        for name, value in values.items():
            module.log(
                name,
                torch.tensor(value, dtype=torch.float64),
                prog_bar=name in shown,
                on_step=True,
                on_epoch=False,
                batch_size=1,
            )
        return
    if isinstance(trainer, L.Fabric):
        row = _ROWS.setdefault(trainer, _Row())
        if row.step is not None and row.step != step:
            write_update_row(trainer)  # the previous update's row; this update starts a new one
            row = _ROWS[trainer]
        row.step = step
        row.metrics.update(values)
        return
    if trainer.global_rank == 0:
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)


def write_update_row(fabric: Any) -> None:
    """Write the metrics collected for the current update as one ``fabric.log_dict(row, step=k)`` and start afresh.

    Does nothing under a Trainer (its logger connector writes the row) or when nothing was collected.
    """
    if not isinstance(fabric, L.Fabric):
        return
    row = _ROWS.get(fabric)
    if row is None or not row.metrics:
        return
    metrics, step = row.metrics, row.step
    _ROWS[fabric] = _Row()
    if fabric.global_rank == 0:
        fabric.log_dict(metrics, step=step)
