"""Trace replay: Eq. 14's recursion, Eq. 15's closed form, Eq. 16-17's endpoints and bound, and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tslightning import cli
from tslightning.measure.trace_replay import last_completion_closed_form, replay_lane, replay_records

jobs_strategy = st.lists(st.tuples(st.floats(0, 10), st.floats(0, 3)), max_size=30)


def test_hand_case():
    # Jobs ready at 1, 2, 6 taking 2, 2, 1: served 1-3, 3-5, 6-7. R = 6, P = 0.5.
    lane = replay_lane([(2, 2), (1, 2), (6, 1)], rollout_close=6, suffix=0.5)
    assert lane.last_completion == 7 and lane.thundersync_end == 7.5
    assert lane.sync_end == 6 + 5 + 0.5 and lane.speedup == pytest.approx(11.5 / 7.5)
    assert lane.async_end == max(6, 5) + 0.5  # the previous batch's 5 s of learner work hides behind R = 6


@given(jobs_strategy, st.floats(0, 20), st.floats(0, 2))
def test_async_estimate_is_never_longer_than_thundersync(jobs, close, suffix):
    lane = replay_lane(jobs, close, suffix)
    assert lane.async_end <= lane.thundersync_end + 1e-9  # c_n >= L: ThunderSync still waits for readiness
    assert lane.async_end >= max(close, lane.learner_service) + suffix - 1e-9


@given(jobs_strategy)
def test_recursion_equals_closed_form(jobs):
    assert replay_lane(jobs, 0.0, 0.0).last_completion == pytest.approx(last_completion_closed_form(jobs))


@given(jobs_strategy, st.floats(0, 2))
def test_speedup_is_at_most_two_when_jobs_are_ready_before_rollout_closes(jobs, suffix):
    close = max([ready for ready, _ in jobs], default=0.0) + 0.01
    lane = replay_lane(jobs, close, suffix)
    assert lane.thundersync_end <= lane.sync_end + 1e-9
    assert lane.speedup <= 2.0 + 1e-9  # Eq. 17


def _trace(tmp_path):
    records = []
    for update, close in enumerate([4.0, 5.0]):
        for j, (ready, service) in enumerate([(1.0, 1.0), (2.0, 1.5), (3.5, 1.0)]):
            records.append(
                {
                    "record": "source",
                    "update": update,
                    "rank": 0,
                    "ready_time": ready + update,
                    "service_start": 10.0 + j,
                    "service_end": 10.0 + j + service,
                }
            )
        records.append(
            {
                "record": "update",
                "update": update,
                "rank": 0,
                "rollout_close": close,
                "barrier_s": 0.2,
                "publication_s": 0.3,
            }
        )
    path = tmp_path / "trace-rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records, path


def test_replay_of_a_trace_file(tmp_path, capsys):
    records, path = _trace(tmp_path)
    replay = replay_records(records)
    first, second = replay.lanes[0]
    # Jobs ready at 1, 2, 3.5 taking 1, 1.5, 1 complete at 2, 3.5, 4.5; R = 4, P = 0.5.
    assert first.last_completion == 4.5 and first.thundersync_end == 5.0
    # One update later the jobs are ready at 2, 3, 4.5: they complete at 3, 4.5, 5.5; R = 5.
    assert second.last_completion == 5.5 and second.thundersync_end == 6.0
    expected = (4.0 + 3.5 + 0.5 + 5.0 + 3.5 + 0.5) / (first.thundersync_end + second.thundersync_end)
    assert replay.predicted_speedup() == pytest.approx(expected)
    cli.main(["replay", "--trace", str(tmp_path), "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary["predicted_speedup"] == pytest.approx(expected)
    # async estimate per update: max(R, L) + P = max(4, 3.5) + 0.5 and max(5, 3.5) + 0.5
    assert summary["mean_async_end_s"] == pytest.approx((4.5 + 5.5) / 2)
    assert summary["thundersync_vs_async"] == pytest.approx((5.0 + 6.0) / (4.5 + 5.5))
    assert replay.async_ends() == [4.5, 5.5] and replay.async_ends(rank=0, warmup=1) == [5.5]
    cli.main(["replay", "--trace", str(tmp_path)])
    assert "one-step-off async estimate max(R, L) + P: 5.000 s (thundersync 1.100x its step)" in capsys.readouterr().out


def test_sources_served_together_share_their_interval_by_tokens():
    shared = {"record": "source", "update": 0, "rank": 0, "service_start": 5.0, "service_end": 8.0}
    records = [
        dict(shared, ready_time=1.0, tokens=200),
        dict(shared, ready_time=3.0, tokens=100),
        {"record": "update", "update": 0, "rank": 0, "rollout_close": 4.0, "barrier_s": 0.0, "publication_s": 0.0},
    ]
    (lane,) = replay_records(records).lanes[0]
    # A sync micro-batch of 3 s: a 2 s job ready at 1 (done at 3), then a 1 s job ready at 3 (done at 4).
    assert lane.learner_service == pytest.approx(3.0) and lane.last_completion == pytest.approx(4.0)
    assert lane.sync_end == pytest.approx(7.0) and lane.thundersync_end == pytest.approx(4.0)


def test_replay_rejects_a_trace_without_updates():
    with pytest.raises(ValueError, match="no finished update"):
        replay_records(
            [{"record": "source", "update": 0, "rank": 0, "ready_time": 0, "service_start": 0, "service_end": 1}]
        )
