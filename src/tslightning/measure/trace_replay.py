"""Release-trace replay (App. F.1, Eqs. 14-17): predicted Sync and ThunderSync endpoints from measured jobs.

Each learner job j has a ready time τ_j and a service time p_j; rollout closes at R; P is the serial suffix
(reduction, optimizer step, publication). On one learner lane, jobs in readiness order complete at

    c_0 = 0,  c_j = max(τ_j, c_{j−1}) + p_j,   T_ThunderSync = max(R, c_n) + P          (Eq. 14)

while Sync starts every job after R: T_Sync = R + L + P with L = Σ p_j (Eq. 16). The predicted speedup of a run is
the ratio of the mean endpoints (App. B's ratio of means), per rank.

The replay also estimates one-step-off Async's step, which the paper gives no equation for: in steady state the
learner serves the previous batch (taken to be the same work, L) while this batch rolls out, so
T_Async ≈ max(R, L) + P. It is never longer than T_ThunderSync (c_n ≥ L), and the gap is what ThunderSync pays for
zero staleness: the wait for the first ready job and the learner's idle gaps before R.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LaneReplay:
    """One update on one learner lane (seconds from the update's first rollout request)."""

    rollout_close: float
    learner_service: float
    suffix: float
    last_completion: float
    thundersync_end: float
    sync_end: float

    @property
    def speedup(self) -> float:
        """S_Sync = T_Sync / T_ThunderSync (Eq. 16); at most 2 (Eq. 17)."""
        return self.sync_end / self.thundersync_end

    @property
    def async_end(self) -> float:
        """Estimated one-step-off Async step, max(R, L) + P: the previous batch's learner work, taken equal to this
        one's, overlaps this rollout (module docstring)."""
        return max(self.rollout_close, self.learner_service) + self.suffix


def replay_lane(jobs: Iterable[tuple[float, float]], rollout_close: float, suffix: float) -> LaneReplay:
    """Eq. 14 on one lane: ``jobs`` are (τ_j, p_j) pairs, served in nondecreasing readiness order."""
    completion = 0.0
    total = 0.0
    for ready, service in sorted(jobs):
        if service < 0:
            raise ValueError(f"a job's service time must be >= 0; got {service}")
        completion = max(ready, completion) + service
        total += service
    return LaneReplay(
        rollout_close=rollout_close,
        learner_service=total,
        suffix=suffix,
        last_completion=completion,
        thundersync_end=max(rollout_close, completion) + suffix,
        sync_end=rollout_close + total + suffix,
    )


def last_completion_closed_form(jobs: Sequence[tuple[float, float]]) -> float:
    """Eq. 15: c_n = max_j (τ_j + Σ_{i≥j} p_i) over jobs in readiness order (0 for no jobs)."""
    ordered = sorted(jobs)
    best, suffix_sum = 0.0, 0.0
    for ready, service in reversed(ordered):
        suffix_sum += service
        best = max(best, ready + suffix_sum)
    return best


@dataclass(frozen=True)
class TraceReplay:
    """Per-rank replays of every update in a release trace, and the predicted speedup (ratio of mean endpoints)."""

    lanes: dict[int, list[LaneReplay]]

    def predicted_speedup(self, rank: int | None = None, warmup: int = 0) -> float:
        """Mean T_Sync / mean T_ThunderSync over updates after ``warmup``; the slowest rank bounds each update."""
        sync, streamed = self.update_ends(rank, warmup)
        return sum(sync) / sum(streamed)

    def update_ends(self, rank: int | None = None, warmup: int = 0) -> tuple[list[float], list[float]]:
        """Per update after ``warmup``: the replayed (T_Sync, T_ThunderSync) endpoints, as two lists (seconds); the
        slowest rank bounds each update unless ``rank`` is given. Pooling several runs' lists gives their joint
        ratio of means."""
        sync = self._per_update("sync_end", rank, warmup)
        if not sync:
            raise ValueError(f"no updates left after warmup={warmup}")
        return sync, self._per_update("thundersync_end", rank, warmup)

    def async_ends(self, rank: int | None = None, warmup: int = 0) -> list[float]:
        """Per update after ``warmup``: the one-step-off async estimate max(R, L) + P (seconds), slowest rank unless
        ``rank`` is given; pairs with :meth:`update_ends`."""
        return self._per_update("async_end", rank, warmup)

    def summary(self, warmup: int = 0) -> dict:
        sync, streamed = self.update_ends(warmup=warmup)
        async_ends = self.async_ends(warmup=warmup)
        return {
            "ranks": sorted(self.lanes),
            "updates": len(next(iter(self.lanes.values()))),
            "warmup": warmup,
            "mean_sync_end_s": _mean(sync),
            "mean_thundersync_end_s": _mean(streamed),
            "predicted_speedup": sum(sync) / sum(streamed),
            "mean_async_end_s": _mean(async_ends),
            "thundersync_vs_async": sum(streamed) / sum(async_ends),
        }

    def _per_update(self, field: str, rank: int | None, warmup: int) -> list[float]:
        """``field`` of every update after ``warmup``: rank ``rank``'s, or the largest over ranks."""
        if rank is not None:
            return [getattr(lane, field) for lane in self.lanes[rank][warmup:]]
        per_update = list(zip(*self.lanes.values(), strict=True))[warmup:]
        return [max(getattr(lane, field) for lane in update) for update in per_update]


def replay_records(records: Iterable[dict]) -> TraceReplay:
    """Replay records as written by :class:`~tslightning.callbacks.ReleaseTraceRecorder` (one or many ranks).

    τ_j is a source's ``ready_time``, p_j its service time, R the update's ``rollout_close`` and
    P = ``barrier_s`` + ``publication_s``. Sources served together (a ``sync`` micro-batch records one interval for
    all of its sources) share that interval's time in proportion to their tokens (context included), each released
    at its own ready time: the replay of a sync trace predicts ThunderSync at sync's learner efficiency.
    """
    jobs: dict[tuple[int, int], dict[tuple[float, float], list[tuple[float, int]]]] = defaultdict(dict)
    lanes: dict[int, list[LaneReplay]] = defaultdict(list)
    for record in records:
        key = (record["rank"], record["update"])
        if record["record"] == "source":
            interval = (record["service_start"], record["service_end"])
            jobs[key].setdefault(interval, []).append((record["ready_time"], record.get("tokens") or 1))
        elif record["record"] == "update":
            served = jobs.pop(key, {})
            pairs = [
                (ready, (end - start) * tokens / sum(t for _, t in members))
                for (start, end), members in served.items()
                for ready, tokens in members
            ]
            suffix = record.get("barrier_s", 0.0) + record.get("publication_s", 0.0)
            lanes[record["rank"]].append(replay_lane(pairs, record["rollout_close"], suffix))
    if not lanes:
        raise ValueError("the trace has no finished update records")
    counts = {rank: len(updates) for rank, updates in lanes.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"ranks recorded different numbers of updates: {counts}")
    return TraceReplay(dict(lanes))


def replay_trace(path: str | Path) -> TraceReplay:
    """Replay a trace file or a directory of ``trace-rank*.jsonl`` files."""
    from tslightning.measure.trace_file import read_trace

    return replay_records(read_trace(path))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
