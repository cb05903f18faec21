"""The pipeline timeline: busy/idle intervals from a hand-made release trace, utilization, and the Fig. 3 PNG."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from tslightning.measure.timeline import busy_intervals, merge_intervals, plot_timeline, utilization

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def source(update: int, start: float, end: float, rank: int = 0) -> dict:
    return {"record": "source", "update": update, "rank": rank, "ready_time": start,
            "service_start": start, "service_end": end}  # fmt: skip


def update(index: int, close: float, barrier: float, publication: float, end: float, rank: int = 0) -> dict:
    return {"record": "update", "update": index, "rank": rank, "rollout_close": close, "learner_service_s": 0.0,
            "barrier_s": barrier, "publication_s": publication, "update_end": end}  # fmt: skip


# Update 0: overlapping services (1, 3) and (2, 4) merge; (6, 7) stands alone; barrier + publication = (7.5, 9).
# Update 1 (from t = 9): no sources; rollout closes at 2, barrier + publication = (2, 3), i.e. (11, 12).
TRACE = [
    source(0, 1.0, 3.0),
    source(0, 2.0, 4.0),
    source(0, 6.0, 7.0),
    update(0, close=5.0, barrier=1.0, publication=0.5, end=9.0),
    update(1, close=2.0, barrier=0.5, publication=0.5, end=3.0),
]


def test_merge_intervals_joins_overlapping_and_touching_and_drops_empty():
    assert merge_intervals([(5.0, 6.0), (1.0, 3.0), (2.0, 4.0), (4.0, 4.5), (7.0, 7.0)]) == [(1.0, 4.5), (5.0, 6.0)]


def test_busy_intervals_lay_updates_end_to_end():
    timeline = busy_intervals(TRACE)
    assert timeline.rollout_busy == ((0.0, 5.0), (9.0, 11.0))
    assert timeline.rollout_idle == ((5.0, 9.0), (11.0, 12.0))
    assert timeline.learner_busy == ((1.0, 4.0), (6.0, 7.0), (7.5, 9.0), (11.0, 12.0))
    assert timeline.learner_idle == ((0.0, 1.0), (4.0, 6.0), (7.0, 7.5), (9.0, 11.0))
    assert [(w.start, w.end, w.rollout_close, w.optimizer_step) for w in timeline.updates] == [
        (0.0, 9.0, 5.0, 8.5),
        (9.0, 12.0, 11.0, 11.5),
    ]
    assert timeline.wall_s == 12.0


def test_utilization_is_the_busy_and_idle_share_of_wall_time():
    shares = utilization(busy_intervals(TRACE))
    assert shares == {
        "wall_s": 12.0,
        "rollout_busy": 7.0 / 12.0,
        "rollout_idle": 5.0 / 12.0,
        "learner_busy": 6.5 / 12.0,
        "learner_idle": 5.5 / 12.0,
    }


def test_service_inside_the_barrier_and_times_outside_the_update_are_clipped():
    # A sync learner serves its sources inside the barrier window; a timer hair outside [0, end] is clamped.
    records = [source(0, -0.25, 1.0), source(0, 3.0, 4.5), update(0, close=3.0, barrier=1.0, publication=0.0, end=4.0)]
    timeline = busy_intervals(records)
    assert timeline.learner_busy == ((0.0, 1.0), (3.0, 4.0))
    assert timeline.learner_idle == ((1.0, 3.0),)


def test_busy_intervals_draws_one_rank_and_defaults_to_the_lowest():
    other = [source(0, 0.0, 2.0, rank=1), update(0, close=1.0, barrier=0.0, publication=0.0, end=2.0, rank=1)]
    assert busy_intervals(other + TRACE) == busy_intervals(TRACE)
    assert busy_intervals(other + TRACE, rank=1).learner_busy == ((0.0, 2.0),)


def test_an_empty_trace_is_an_empty_timeline():
    timeline = busy_intervals([])
    assert timeline.wall_s == 0.0 and timeline.learner_busy == timeline.learner_idle == ()
    assert utilization(timeline)["learner_idle"] == 0.0


def write_trace(directory: Path, records: list[dict]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trace-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return directory


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] > 0 and image.shape[1] > 0
    assert image[..., :3].min() < 1.0  # something was drawn on the white figure


@pytest.mark.parametrize(
    "records",
    [
        pytest.param(TRACE, id="trace"),
        pytest.param([update(0, close=1.0, barrier=0.1, publication=0.1, end=1.5)], id="zero-sources"),
        pytest.param([], id="no-updates"),
    ],
)
def test_plot_timeline_writes_a_png(tmp_path, records):
    trace = write_trace(tmp_path / "trace", records)
    png = tmp_path / "plots" / "timeline.png"
    shares = plot_timeline(trace, png, title="test")
    assert_png(png)
    assert shares == utilization(busy_intervals(records))
