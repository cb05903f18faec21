"""Speedup figures: Figs. 9-10 surfaces and Fig. 8's scatter are written as valid PNGs (no pixel comparisons)."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import matplotlib
import pytest

from tslightning.measure.analytical_model import SpeedupModelParameters
from tslightning.measure.speedup_plots import (
    SpeedupPoint,
    predicted_vs_measured_png,
    ratio_batch_png,
    ratio_turns_png,
    write_speedup_surfaces,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from the IHDR chunk, after checking the signature and the IEND trailer."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR" and data.endswith(b"IEND\xaeB`\x82")
    return struct.unpack(">II", data[16:24])


def assert_plausible_png(path: Path, min_width: int, min_height: int) -> None:
    width, height = png_size(path)
    assert width >= min_width and height >= min_height
    assert 10_000 < path.stat().st_size < 5_000_000


def test_surfaces_written(tmp_path):
    paths = write_speedup_surfaces(tmp_path / "plots", resolution=8)
    assert [p.name for p in paths] == ["speedup_ratio_turns.png", "speedup_ratio_batch.png"]
    for path in paths:
        assert_plausible_png(path, min_width=1000, min_height=600)


def test_single_surfaces_with_custom_panels_and_parameters(tmp_path):
    params = SpeedupModelParameters(capacity=64, suffix=0.1)
    turns_png = ratio_turns_png(tmp_path / "a.png", batches=(128,), parameters=params, resolution=6)
    batch_png = ratio_batch_png(tmp_path / "b.png", turns=(20, 200), parameters=params, resolution=6)
    assert_plausible_png(turns_png, min_width=400, min_height=600)
    assert_plausible_png(batch_png, min_width=700, min_height=600)
    with pytest.raises(ValueError, match="resolution"):
        ratio_turns_png(tmp_path / "c.png", resolution=1)


def test_predicted_vs_measured_scatter(tmp_path):
    points = [
        SpeedupPoint("grpo B=256", 1.84, 1.71),
        SpeedupPoint("grpo B=256", 1.35, 1.30),
        ("opd B=256", 1.97, 1.86),  # plain tuples work too
    ]
    path = predicted_vs_measured_png(points, tmp_path / "nested" / "fig8.png")
    assert path == tmp_path / "nested" / "fig8.png"
    assert_plausible_png(path, min_width=500, min_height=500)


@pytest.mark.parametrize(
    ("points", "message"),
    [([], "at least one"), ([("x", 1.5, math.nan)], "measured"), ([("x", 0.0, 1.2)], "predicted")],
)
def test_scatter_rejects_bad_points(tmp_path, points, message):
    with pytest.raises(ValueError, match=message):
        predicted_vs_measured_png(points, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_plots_leave_pyplot_backend_alone(tmp_path):
    backend = matplotlib.get_backend()
    predicted_vs_measured_png([("x", 1.5, 1.4)], tmp_path / "s.png")
    assert matplotlib.get_backend() == backend
