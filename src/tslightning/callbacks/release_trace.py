"""The release trace (App. B, F): per source its ready time τ_j and learner service interval, per update the
rollout close R and the barrier and publication durations — the inputs of the replay c_j = max(τ_j, c_{j−1}) + p_j,
T = max(R, c_n) + P (Eqs. 14-15), one lane per rank.

Each rank appends to its own ``trace-rank{r}.jsonl`` in ``path``, one JSON object per line, flushed at the end of every
update, so a run that stops keeps every finished update. A fresh run starts the file afresh; a resumed one (its state
restored from a checkpoint) keeps the records of the updates before the checkpoint's next update and appends after
them. Times are seconds relative to the update's start (its :class:`~tslightning.core.batch_registry.BatchPlan`; a
plain module's batch start). Works under a Trainer and Fabric, on any module with a ``service_log`` (see
:mod:`tslightning.callbacks.update_callback`); without one it writes the update records only, and warns once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from tslightning.callbacks.update_callback import UpdateCallback, module_name
from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed
from tslightning.measure.trace_file import trace_file_name


class ReleaseTraceRecorder(UpdateCallback):
    """Writes one ``"source"`` record per served source and one ``"update"`` record per update.

    Source records: ``update`` (k), ``rank``, ``task`` (``None`` unless the datamodule knows it), ``group``,
    ``trajectory``, ``turn`` (``None`` for a GRPO trajectory), ``kind``, ``policy_version``, ``ready_time`` τ_j,
    ``service_start``/``service_end``, ``scored_tokens``, ``tokens`` (context included) and ``deferred_completion``
    (``None``: the context-recompute learner defers no work); with a datamodule, how its actions were generated:
    ``generated_tokens``, ``generation_s`` (its requests' seconds) and speculative decoding's ``spec_steps``,
    ``spec_drafted``, ``spec_accepted`` (``None``: sampled without speculation). Update records: ``update``,
    ``rank``, ``rollout_close`` R, ``learner_service_s``, ``barrier_s``, ``publication_s``, ``update_end`` and
    ``num_sources``.

    It reads ``publication_s`` from the :class:`~tslightning.callbacks.WeightPublisher`, so it refuses to come
    before one in the callbacks.

    Args:
        path: Directory of the per-rank trace files (created when missing).
        datamodule: The :class:`~tslightning.rollout.rollout_datamodule.RolloutDataModule`; its ``ready_log`` gives
            τ_j and R and its ``trajectories`` the task of each source. Without it, τ_j is the service start (the
            learner never lets a ready source wait, as far as the trace can tell) and R when the learner saw
            :class:`BatchClosed`.
        name: Distinguishes several recorders in a checkpoint (their ``state_key``).
    """

    reads_publication = True

    def __init__(self, path: str | os.PathLike[str], datamodule: Any = None, name: str | None = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.datamodule = datamodule
        self.name = name
        self.next_update = 0
        """One past the last update written; a resumed run keeps the records before it."""
        self._resumed = False
        self._started_file = False
        self._origin: float | None = None
        self._plan_version: int | None = None
        self._closed_at: float | None = None
        self._ready_cursor = 0

    @property
    def state_key(self) -> str:
        return type(self).__qualname__ if self.name is None else self._generate_state_key(name=self.name)

    def trace_file(self, rank: int) -> Path:
        """The trace file rank ``rank`` writes."""
        return self.path / trace_file_name(rank)

    def check_host(self, trainer: Any, pl_module: Any) -> None:
        if getattr(pl_module, "service_log", None) is None:
            self.warn_once(
                f"{module_name(pl_module)} has no `service_log`: the trace gets update records only (no per-source "
                "ready and service times for the replay)"
            )

    def on_update_start(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """The update's time origin; a :class:`BatchPlan` also names the sampling version of its readiness records."""
        self._origin, self._closed_at = time.perf_counter(), None
        self._plan_version = batch.policy_version if isinstance(batch, BatchPlan) else None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """(One item per batch:) :class:`BatchClosed` marks when the learner saw R."""
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if isinstance(batch, BatchClosed) and self._origin is not None:
            self._closed_at = time.perf_counter() - self._origin

    def on_update_end(self, trainer: Any, pl_module: Any, k: int, batch: Any) -> None:
        """Update k stepped and was published: append its records and flush."""
        if self._origin is None:
            return
        end = time.perf_counter() - self._origin
        records = self._records(trainer, pl_module, k, end)
        file = self._start_file(trainer.global_rank)
        with file.open("a") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in records)
        self._origin = None
        self.next_update = k + 1

    def state_dict(self) -> dict[str, Any]:
        return {"next_update": self.next_update}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.next_update = state_dict["next_update"]
        self._resumed, self._started_file = True, False

    def _start_file(self, rank: int) -> Path:
        """This rank's file, emptied at a fresh run's first update; a resumed run drops the records of updates from
        its checkpoint's next update on (written after the checkpoint by the run that stopped)."""
        file = self.trace_file(rank)
        if not self._started_file:
            self.path.mkdir(parents=True, exist_ok=True)
            kept = []
            if self._resumed and file.is_file():
                kept = [line for line in file.read_text().splitlines(keepends=True) if _before(line, self.next_update)]
            file.write_text("".join(kept))
            self._started_file = True
        return file

    def _records(self, trainer: Any, module: Any, k: int, end: float) -> list[dict[str, Any]]:
        ready, trajectories, rollout_close, rollout_start = self._readiness()
        if rollout_start is not None:  # the datamodule's first rollout request is the exact time origin
            end += self._origin - rollout_start
            self._origin = rollout_start
        timings = getattr(module, "update_timings", None) or {}
        update = {"update": k, "rank": trainer.global_rank}
        sources = []
        for r in getattr(module, "service_log", None) or ():
            start, stop = r.start - self._origin, r.end - self._origin
            key = (r.kind, r.group_id, r.trajectory_index, r.turn_index)
            trajectory = trajectories.get((r.group_id, r.trajectory_index))
            sources.append(
                {
                    "record": "source",
                    **update,
                    "task": None if trajectory is None else trajectory.task_id,
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
                    **(_generation(trajectory, r.turn_index) if trajectory is not None else {}),
                }
            )
        publication = self.publication(trainer, module, k)
        barrier_s, publication_s = timings.get("barrier_s", 0.0), 0.0 if publication is None else publication.seconds
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

    def _readiness(self) -> tuple[dict[tuple, float], dict[tuple, Any], float | None, float | None]:
        """τ_j per (kind, group, trajectory, turn), the trajectory per (group, trajectory), R, and the update's start
        (``perf_counter``), from the datamodule."""
        if self.datamodule is None:
            return {}, {}, None, None
        log = self.datamodule.ready_log
        closing = next(
            (i for i in range(self._ready_cursor, len(log)) if _closes(log[i], self._plan_version)),
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
        by_source = {(t.group_id, t.trajectory_index): t for t in trajectories}
        start = getattr(self.datamodule, "update_starts", {}).get(update)
        return ready, by_source, log[closing].ready_time, start


def _generation(trajectory: Any, turn: int | None) -> dict[str, Any]:
    """How a source's actions were generated (a trajectory's, or turn ``turn``'s), when the trajectory can tell."""
    record = getattr(trajectory, "generation_record", None)
    return record(turn) if record is not None else {}


def _closes(record: Any, version: int | None) -> bool:
    """The readiness record of BatchClosed (of the plan's sampling version, when the plan was seen)."""
    return record.kind == BatchClosed.__name__ and version in (None, record.policy_version)


def _before(line: str, update: int) -> bool:
    return bool(line.strip()) and json.loads(line).get("update", update) < update
