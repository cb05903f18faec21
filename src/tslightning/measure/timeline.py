"""The pipeline timeline (Fig. 3): when the rollout pool and the learner are busy or idle, read from a release trace.

Per update, rollout is busy from the update's start to the rollout close R; the learner is busy during the union of
its source service intervals and during the barrier and publication that end the update; each lane is idle for the
rest of the update. Updates are laid end to end on one time axis (update k starts where update k−1 ended), so the
axis is the learner's wall clock; under ``async`` the next batch's rollout overlaps the current update, which this
end-to-end layout does not show.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tslightning.measure.trace_file import read_trace

Interval = tuple[float, float]
"""``(start, end)`` in seconds on the timeline's axis."""


@dataclass(frozen=True)
class UpdateWindow:
    """One update on the timeline's axis: its span, its rollout close R and its optimizer step."""

    update: int
    start: float
    end: float
    rollout_close: float
    optimizer_step: float
    """When the barrier ended (the step was taken); publication follows until ``end``."""


@dataclass(frozen=True)
class Timeline:
    """Busy and idle intervals of the rollout and learner lanes; each lane's busy and idle intervals tile
    ``[0, wall_s]``."""

    rollout_busy: tuple[Interval, ...]
    rollout_idle: tuple[Interval, ...]
    learner_busy: tuple[Interval, ...]
    learner_idle: tuple[Interval, ...]
    updates: tuple[UpdateWindow, ...]

    @property
    def wall_s(self) -> float:
        """The summed wall time of the updates."""
        return self.updates[-1].end if self.updates else 0.0


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals (empty ones dropped, touching ones joined)."""
    merged: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def busy_intervals(records: Sequence[dict[str, Any]], rank: int | None = None) -> Timeline:
    """The timeline of one rank's release trace (records as :func:`~tslightning.callbacks.release_trace.read_trace`
    returns them).

    Args:
        records: Source and update records in file order (each update's sources precede its update record).
        rank: The rank whose lane to draw; ``None``: the lowest rank in ``records``.
    """
    if rank is None:
        rank = min((r.get("rank", 0) for r in records), default=0)
    rollout: list[Interval] = []
    learner: list[Interval] = []
    windows: list[UpdateWindow] = []
    offset = 0.0
    for sources, summary in _updates(records, rank):
        end = max(float(summary["update_end"]), 0.0)
        close = _clamp(summary["rollout_close"], end)
        barrier_start = _clamp(end - summary["barrier_s"] - summary["publication_s"], end)
        served = [(_clamp(s["service_start"], end), _clamp(s["service_end"], end)) for s in sources]
        rollout.append((offset, offset + close))
        learner.extend((offset + a, offset + b) for a, b in [*served, (barrier_start, end)])
        step = _clamp(end - summary["publication_s"], end)
        windows.append(UpdateWindow(summary["update"], offset, offset + end, offset + close, offset + step))
        offset += end
    rollout, learner = merge_intervals(rollout), merge_intervals(learner)
    rollout_idle, learner_idle = _complement(rollout, offset), _complement(learner, offset)
    return Timeline(tuple(rollout), tuple(rollout_idle), tuple(learner), tuple(learner_idle), tuple(windows))


def utilization(timeline: Timeline) -> dict[str, float]:
    """Fractions of wall time each lane is busy and idle, and the wall time: ``wall_s``, ``rollout_busy``,
    ``rollout_idle``, ``learner_busy``, ``learner_idle`` (all fractions 0 for an empty timeline)."""
    wall = timeline.wall_s

    def share(intervals: Iterable[Interval]) -> float:
        return sum(b - a for a, b in intervals) / wall if wall > 0 else 0.0

    return {
        "wall_s": wall,
        "rollout_busy": share(timeline.rollout_busy),
        "rollout_idle": share(timeline.rollout_idle),
        "learner_busy": share(timeline.learner_busy),
        "learner_idle": share(timeline.learner_idle),
    }


def plot_timeline(
    trace_path: str | os.PathLike[str], png_path: str | os.PathLike[str], title: str | None = None
) -> dict[str, float]:
    """Draw a Fig. 3-style timeline of a release trace (a trace file or directory; its lowest rank) to a PNG.

    Two lanes, rollout above and learner below: busy bars, hatched idle bars, a dashed line at each optimizer step,
    and a legend giving the learner idle fraction. Renders with Agg (no display needed).

    Returns:
        The :func:`utilization` of the drawn timeline.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: only plotting needs matplotlib
    from matplotlib.figure import Figure

    timeline = busy_intervals(read_trace(trace_path))
    shares = utilization(timeline)
    figure = Figure(figsize=(10, 2.8), layout="constrained")
    FigureCanvasAgg(figure)  # the Agg canvas, not pyplot's global backend
    axes = figure.add_subplot()
    _draw_lanes(axes, timeline)
    axes.legend(handles=_legend(shares), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    axes.set_title(title or f"{len(timeline.updates)} updates, {timeline.wall_s:.1f} s")
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png_path, dpi=120)
    return shares


_LANES = {"rollout": (1.0, "tab:blue"), "learner": (0.0, "tab:orange")}
_IDLE = {"facecolor": "0.93", "edgecolor": "0.6", "hatch": "///", "linewidth": 0.0}


def _draw_lanes(axes: Any, timeline: Timeline) -> None:
    for lane, (y, color) in _LANES.items():
        for intervals, style in (
            (getattr(timeline, f"{lane}_busy"), {"facecolor": color}),
            (getattr(timeline, f"{lane}_idle"), _IDLE),
        ):
            axes.broken_barh([(a, b - a) for a, b in intervals], (y - 0.35, 0.7), **style)
    for window in timeline.updates:
        axes.axvline(window.optimizer_step, color="0.25", linestyle="--", linewidth=0.8)
    axes.set_yticks([y for y, _ in _LANES.values()], list(_LANES))
    axes.set_ylim(-0.6, 1.6)
    axes.set_xlim(0.0, 1.01 * timeline.wall_s or 1.0)  # a margin keeps the last optimizer step visible
    axes.set_xlabel("wall time (s)")
    if not timeline.updates:
        axes.text(0.5, 0.5, "no finished updates", transform=axes.transAxes, ha="center", va="center")


def _legend(shares: dict[str, float]) -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [
        Patch(facecolor=_LANES["rollout"][1], label=f"rollout busy ({shares['rollout_busy']:.0%})"),
        Patch(facecolor=_LANES["learner"][1], label=f"learner busy ({shares['learner_busy']:.0%})"),
        Patch(**{**_IDLE, "linewidth": 0.5}, label=f"idle (learner idle {shares['learner_idle']:.1%})"),
        Line2D([], [], color="0.25", linestyle="--", linewidth=0.8, label="optimizer step"),
    ]


def _updates(records: Sequence[dict[str, Any]], rank: int) -> Iterator[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """``(sources, update record)`` per update of ``rank``, in file order (a resumed run's repeats included)."""
    sources: list[dict[str, Any]] = []
    for record in records:
        if record.get("rank", 0) != rank:
            continue
        if record.get("record") == "update":
            yield sources, record
            sources = []
        elif record.get("record") == "source":
            sources.append(record)


def _clamp(time: float, end: float) -> float:
    """``time`` within the update ``[0, end]`` (timer skew can put a recorded time a hair outside it)."""
    return min(max(float(time), 0.0), end)


def _complement(busy: Sequence[Interval], end: float) -> list[Interval]:
    """The gaps of the sorted, disjoint ``busy`` within ``[0, end]``."""
    gaps, cursor = [], 0.0
    for a, b in busy:
        if a > cursor:
            gaps.append((cursor, a))
        cursor = max(cursor, b)
    if end > cursor:
        gaps.append((cursor, end))
    return gaps


__all__ = ["Interval", "Timeline", "UpdateWindow", "busy_intervals", "merge_intervals", "plot_timeline", "utilization"]
