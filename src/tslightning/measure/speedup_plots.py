"""Speedup figures as PNGs: the analytical surfaces of Figs. 9-10 and Fig. 8's predicted-vs-measured scatter.

Figs. 9 and 10 evaluate Eq. 26 (App. F.6) over the rollout-to-learner ratio r ∈ [0.3, 4] against turns per trajectory
at fixed batch sizes (Fig. 9) and against trajectories per step at fixed horizons (Fig. 10), GRPO above OPD. The
scatter compares a prediction (trace replay through Eq. 14, or the analytical model) with measured wall-clock
speedups against the y = x line, reporting Eq. 29's mean gap. Figures are drawn on an Agg canvas, never through
pyplot, so importing this module changes no global matplotlib state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from tslightning.measure.analytical_model import OBJECTIVES, SpeedupModelParameters, predict_speedup

RATIO_RANGE = (0.3, 4.0)
"""App. F.6's sweep of r = T_rollout / T_train."""
SURFACE_BATCHES = (256, 512, 1024, 2048)
"""Fig. 9's panels: trajectories per optimizer step."""
SURFACE_TURNS = (10, 30, 100, 300)
"""Fig. 10's panels: agentic turns per trajectory."""
_LEVELS = [1.0 + 0.05 * i for i in range(21)]
_CONTOURS = [1.25, 1.5, 1.75, 1.9]
_RATIO_TICKS = [0.3, 0.5, 1.0, 2.0, 4.0]
_DPI = 110


class SpeedupPoint(NamedTuple):
    """One configuration of Fig. 8's scatter; a plain ``(label, predicted, measured)`` tuple works as well."""

    label: str
    """Series name: points sharing a label share a colour and one legend entry (e.g. ``"grpo B=256"``)."""
    predicted: float
    """Predicted speedup S_Sync (trace replay, Eq. 14, or the analytical model, Eq. 26)."""
    measured: float
    """Measured wall-clock speedup T_Sync / T_ThunderSync."""


def predicted_vs_measured_png(points: Iterable[SpeedupPoint | tuple[str, float, float]], path: str | Path) -> Path:
    """Write Fig. 8's scatter: predicted (x) against measured (y) speedup, with the y = x line and Eq. 29's gap.

    Args:
        points: ``(label, predicted, measured)`` triples (or :class:`SpeedupPoint`); points sharing a label form
            one series in the legend. Speedups must be finite and positive.
        path: The PNG to write (parent directories are created).

    Returns:
        The written path.

    Raises:
        ValueError: when there are no points or a speedup is not a finite positive number (naming the point).
    """
    series = _series(points)
    figure = Figure(figsize=(6.0, 6.0), dpi=_DPI)
    axes = figure.subplots()
    values = [v for predicted, measured in series.values() for v in (*predicted, *measured)]
    low, high = min(1.0, *values) - 0.05, max(2.0, *values) + 0.05
    axes.plot([low, high], [low, high], color="0.4", linestyle="--", linewidth=1, label="y = x")
    for label, (predicted, measured) in series.items():
        axes.scatter(predicted, measured, s=28, alpha=0.85, label=label)
    pairs = [pair for predicted, measured in series.values() for pair in zip(predicted, measured, strict=True)]
    gaps = [100 * (p - m) / p for p, m in pairs]  # Eq. 29's d_i
    axes.set(xlim=(low, high), ylim=(low, high), aspect="equal")
    axes.set_xlabel("Predicted speedup over Sync (×)")
    axes.set_ylabel("Measured speedup over Sync (×)")
    axes.set_title(f"{len(gaps)} configuration(s); mean gap (pred − meas)/pred = {sum(gaps) / len(gaps):.1f}%")
    axes.grid(alpha=0.3)
    axes.legend(loc="upper left", fontsize="small")
    return _save(figure, path)


def ratio_turns_png(
    path: str | Path,
    batches: Sequence[int] = SURFACE_BATCHES,
    parameters: SpeedupModelParameters | None = None,
    resolution: int = 48,
) -> Path:
    """Write Fig. 9: predicted speedup over r (x) and turns per trajectory (y), one panel per batch size.

    Args:
        path: The PNG to write.
        batches: Trajectories per optimizer step of the panels (columns).
        parameters: App. F.5's parameters; ``None`` takes the paper's.
        resolution: Grid points along each axis.
    """
    _check_resolution(resolution)
    turns = _log_integers(1, 300, resolution)
    panels = [(f"B = {batch} traj./step", lambda r, a, b=batch: (b, r, a)) for batch in batches]
    axis = ("Agentic turns per trajectory", [1, 4, 10, 20, 100, 300])
    return _surfaces(path, panels, turns, axis, parameters, resolution)


def ratio_batch_png(
    path: str | Path,
    turns: Sequence[int] = SURFACE_TURNS,
    parameters: SpeedupModelParameters | None = None,
    resolution: int = 48,
) -> Path:
    """Write Fig. 10: predicted speedup over r (x) and trajectories per step (y), one panel per horizon.

    Args:
        path: The PNG to write.
        turns: Agentic turns per trajectory of the panels (columns).
        parameters: App. F.5's parameters; ``None`` takes the paper's.
        resolution: Grid points along each axis.
    """
    _check_resolution(resolution)
    batches = _log_integers(64, 2048, resolution)
    panels = [(f"a = {horizon} turns", lambda r, b, a=horizon: (b, r, a)) for horizon in turns]
    axis = ("Trajectories per optimizer step", [64, 128, 256, 512, 1024, 2048])
    return _surfaces(path, panels, batches, axis, parameters, resolution)


def write_speedup_surfaces(
    directory: str | Path, parameters: SpeedupModelParameters | None = None, resolution: int = 48
) -> list[Path]:
    """Write Figs. 9 and 10 into ``directory`` (created if missing); returns the two paths."""
    directory = Path(directory)
    return [
        ratio_turns_png(directory / "speedup_ratio_turns.png", parameters=parameters, resolution=resolution),
        ratio_batch_png(directory / "speedup_ratio_batch.png", parameters=parameters, resolution=resolution),
    ]


def _surfaces(
    path: str | Path,
    panels: list[tuple[str, Callable[[float, int], tuple[int, float, int]]]],
    rows: list[int],
    row_axis: tuple[str, list[int]],
    parameters: SpeedupModelParameters | None,
    resolution: int,
) -> Path:
    """GRPO above OPD, one column per panel: filled contours of Eq. 26 over (r, rows)."""
    ratios = [RATIO_RANGE[0] * (RATIO_RANGE[1] / RATIO_RANGE[0]) ** (i / (resolution - 1)) for i in range(resolution)]
    figure = Figure(figsize=(3.6 * len(panels) + 1.2, 6.4), dpi=_DPI, layout="constrained")
    grid = figure.subplots(len(OBJECTIVES), len(panels), squeeze=False, sharex=True, sharey=True)
    for row, objective in enumerate(OBJECTIVES):
        for column, (title, workload) in enumerate(panels):
            values = [
                [predict_speedup(objective, *workload(r, y), parameters=parameters).speedup for r in ratios]
                for y in rows
            ]
            axes = grid[row][column]
            filled = axes.contourf(ratios, rows, values, levels=_LEVELS, cmap="viridis", extend="neither")
            lines = axes.contour(ratios, rows, values, levels=_CONTOURS, colors="white", linewidths=0.6)
            axes.clabel(lines, fmt="%.2f", fontsize=7)
            axes.axvline(1.0, color="white", linestyle=":", linewidth=0.8)
            axes.set(xscale="log", yscale="log", title=f"{objective.upper()}, {title}")
            _label_log_axes(axes, row_axis[1])
            if row == len(OBJECTIVES) - 1:
                axes.set_xlabel("T_rollout / T_train")
            if column == 0:
                axes.set_ylabel(row_axis[0])
    figure.colorbar(filled, ax=grid, label="Predicted speedup over Sync (×)", ticks=[1.0, 1.25, 1.5, 1.75, 2.0])
    return _save(figure, path)


def _label_log_axes(axes: Axes, row_ticks: list[int]) -> None:
    """Plain-number ticks on both log axes (matplotlib's default labels every minor tick as 3×10⁻¹ …)."""
    axes.set_xticks(_RATIO_TICKS, labels=[f"{tick:g}" for tick in _RATIO_TICKS])
    axes.set_yticks(row_ticks, labels=[str(tick) for tick in row_ticks])
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.yaxis.set_minor_formatter(NullFormatter())


def _series(points: Iterable[SpeedupPoint | tuple[str, float, float]]) -> dict[str, tuple[list[float], list[float]]]:
    series: dict[str, tuple[list[float], list[float]]] = {}
    for index, (label, predicted, measured) in enumerate(points):
        for name, value in (("predicted", predicted), ("measured", measured)):
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                problem = f"{name} speedup must be a finite number > 0; got {value!r}"
                raise ValueError(f"point {index} ({label!r}): {problem}")
        xs, ys = series.setdefault(str(label), ([], []))
        xs.append(float(predicted))
        ys.append(float(measured))
    if not series:
        raise ValueError("predicted_vs_measured_png needs at least one (label, predicted, measured) point")
    return series


def _check_resolution(resolution: int) -> None:
    if resolution < 2:
        raise ValueError(f"resolution must be >= 2 grid points per axis; got {resolution}")


def _log_integers(low: int, high: int, count: int) -> list[int]:
    """About ``count`` distinct integers spaced evenly in log between ``low`` and ``high`` (both included)."""
    return sorted({round(low * (high / low) ** (i / (count - 1))) for i in range(count)})


def _save(figure: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(figure)  # draw on Agg whatever pyplot's backend is
    figure.savefig(path, format="png")
    return path
