"""The release trace (SPEC §4, App. B/F): per source its ready time τ_j and learner service interval, per update the
rollout close R and the barrier and publication durations — the inputs of the replay c_j = max(τ_j, c_{j−1}) + p_j,
T = max(R, c_n) + P (Eqs. 14-15), one lane per rank.

Each rank appends to its own ``trace-rank{r}.jsonl`` in ``path``, one JSON object per line, flushed at the end of every
update, so a run that stops keeps every finished update. Times are seconds relative to the update's start (its
:class:`~tslightning.core.batch_registry.BatchPlan`). Works under a Trainer and Fabric (it touches ``.global_rank``
only).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed
from tslightning.measure.trace_file import trace_file_name


class ReleaseTraceRecorder(L.Callback):
    """Writes one ``"source"`` record per served source and one ``"update"`` record per update.

    Source records: ``update``, ``rank``, ``task`` (``None`` unless the datamodule knows it), ``group``,
    ``trajectory``, ``turn`` (``None`` for a GRPO trajectory), ``kind``, ``policy_version``, ``ready_time`` τ_j,
    ``service_start``/``service_end``, ``scored_tokens``, ``tokens`` (context included) and ``deferred_completion``
    (``None``: the context-recompute learner defers no work). Update records: ``update``, ``rank``, ``rollout_close``
    R, ``learner_service_s``, ``barrier_s``, ``publication_s``, ``update_end`` and ``num_sources``.

    Order it after the :class:`~tslightning.callbacks.WeightPublisher` so ``publication_s`` is known.

    Args:
        path: Directory of the per-rank trace files (created when missing).
        datamodule: The :class:`~tslightning.rollout.rollout_datamodule.RolloutDataModule`; its ``ready_log`` gives
            τ_j and R and its ``trajectories`` the task of each source. Without it, τ_j is the service start (the
            learner never lets a ready source wait, as far as the trace can tell) and R when the learner saw
            :class:`BatchClosed`.
    """

    def __init__(self, path: str | os.PathLike[str], datamodule: Any = None) -> None:
        self.path = Path(path)
        self.datamodule = datamodule
        self._origin: float | None = None
        self._version = 0
        self._closed_at: float | None = None
        self._ready_cursor = 0

    def trace_file(self, rank: int) -> Path:
        """The trace file rank ``rank`` appends to."""
        return self.path / trace_file_name(rank)

    def on_train_batch_start(self, trainer: L.Trainer | L.Fabric, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """A :class:`BatchPlan` is the update's time origin; :class:`BatchClosed` marks when the learner saw R."""
        if isinstance(batch, BatchPlan):
            self._origin, self._version, self._closed_at = time.perf_counter(), batch.policy_version, None
        elif isinstance(batch, BatchClosed) and self._origin is not None:
            self._closed_at = time.perf_counter() - self._origin

    def on_train_batch_end(
        self, trainer: L.Trainer | L.Fabric, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """On :class:`BatchClosed` (stepped and published): append the update's records and flush."""
        if not isinstance(batch, BatchClosed) or self._origin is None:
            return
        end = time.perf_counter() - self._origin
        records = self._records(pl_module, trainer.global_rank, end)
        self.path.mkdir(parents=True, exist_ok=True)
        with self.trace_file(trainer.global_rank).open("a") as file:
            file.writelines(json.dumps(record) + "\n" for record in records)
        self._origin = None

    def _records(self, module: Any, rank: int, end: float) -> list[dict[str, Any]]:
        ready, tasks, rollout_close, rollout_start = self._readiness()
        if rollout_start is not None:  # the datamodule's first rollout request is the exact time origin
            end += self._origin - rollout_start
            self._origin = rollout_start
        timings = module.update_timings
        update = {"update": self._version, "rank": rank}
        sources = []
        for r in module.service_log:
            start, stop = r.start - self._origin, r.end - self._origin
            key = (r.kind, r.group_id, r.trajectory_index, r.turn_index)
            sources.append(
                {
                    "record": "source",
                    **update,
                    "task": tasks.get((r.group_id, r.trajectory_index)),
                    "group": r.group_id,
                    "trajectory": r.trajectory_index,
                    "turn": r.turn_index,
                    "kind": r.kind,
                    "policy_version": r.policy_version,
                    "ready_time": ready.get(key, start),
                    "service_start": start,
                    "service_end": stop,
                    "scored_tokens": r.scored_tokens,
                    "tokens": r.tokens,
                    "deferred_completion": None,
                }
            )
        barrier_s, publication_s = timings.get("barrier_s", 0.0), timings.get("publication_s", 0.0)
        if rollout_close is None:
            rollout_close = self._closed_at  # when the learner received BatchClosed
        if rollout_close is None:  # when the barrier began: the end less publication, barrier and sync learner work
            rollout_close = end - publication_s - barrier_s - timings.get("sync_s", 0.0)
        summary = {
            "record": "update",
            **update,
            "rollout_close": rollout_close,
            "learner_service_s": timings.get("learner_service_s", 0.0),
            "barrier_s": barrier_s,
            "publication_s": publication_s,
            "update_end": end,
            "num_sources": len(sources),
        }
        return [*sources, summary]

    def _readiness(self) -> tuple[dict[tuple, float], dict[tuple, str], float | None, float | None]:
        """τ_j per (kind, group, trajectory, turn), task per (group, trajectory), R, and the update's start
        (``perf_counter``), from the datamodule."""
        if self.datamodule is None:
            return {}, {}, None, None
        log = self.datamodule.ready_log
        closing = next(
            (i for i in range(self._ready_cursor, len(log)) if _closes(log[i], self._version)),
            None,
        )
        if closing is None:
            return {}, {}, None, None
        update = log[closing].update
        ready = {
            (r.kind, r.group_id, r.trajectory_index, r.turn_index): r.ready_time
            for r in log[self._ready_cursor : closing]
            if r.update == update
        }
        self._ready_cursor = closing + 1
        trajectories = getattr(self.datamodule, "trajectories", {}).get(update, [])
        tasks = {(t.group_id, t.trajectory_index): t.task_id for t in trajectories}
        start = getattr(self.datamodule, "update_starts", {}).get(update)
        return ready, tasks, log[closing].ready_time, start


def _closes(record: Any, version: int) -> bool:
    return record.kind == BatchClosed.__name__ and record.policy_version == version
