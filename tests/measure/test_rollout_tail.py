"""The rollout tail read from a release trace: τ from the 90th-percentile trajectory to the last, the tail's tokens per
second, and speculative decoding's acceptance."""

from __future__ import annotations

import math

import pytest

from tslightning.measure.rollout_tail import rollout_tail


def source(trajectory, ready, tokens=10, seconds=1.0, drafted=None, accepted=None, group="g", turn=None):
    return {
        "record": "source", "update": 0, "rank": 0, "group": group, "trajectory": trajectory, "turn": turn,
        "ready_time": ready, "generated_tokens": tokens, "generation_s": seconds, "spec_drafted": drafted,
        "spec_accepted": accepted,
    }  # fmt: skip


def test_the_tail_runs_from_the_90th_percentile_trajectory_to_the_last():
    records = [source(i, float(i)) for i in range(10)]  # ready at 0..9: the 9th (ready 8) is the 90th percentile
    records[-1] = source(9, 20.0, tokens=300, seconds=2.0)
    tail = rollout_tail(records)
    assert tail.tail_s == 12.0  # 20 − 8
    assert tail.tail_tokens == 300 and tail.tail_tokens_per_s == 150.0  # only the last one is after the cut
    assert tail.drafted == 0 and tail.accepted == 0


def test_opd_turns_make_one_trajectory_ready_at_its_last_turn_and_spec_counts_add_up():
    records = [source(0, 1.0, 5, 0.5, 8, 6, turn=0), source(0, 3.0, 7, 0.5, 4, 1, turn=1), source(1, 2.0, 9, 1.0)]
    tail = rollout_tail(records, quantile=0.5)
    assert tail.tail_s == 1.0  # trajectory 1 at 2.0 is the median, trajectory 0 (its last turn at 3.0) the last
    assert (tail.tail_tokens, tail.tail_generation_s) == (12, 1.0)
    assert (tail.drafted, tail.accepted) == (12, 7)


def test_records_without_generation_fields_give_no_rate():
    tail = rollout_tail([{"record": "source", "ready_time": 1.0}, {"record": "source", "ready_time": 4.0}], 0.5)
    assert tail.tail_s == 3.0 and math.isnan(tail.tail_tokens_per_s)
    with pytest.raises(ValueError, match="source records"):
        rollout_tail([{"record": "update"}])
    with pytest.raises(ValueError, match="quantile"):
        rollout_tail(records=[source(0, 1.0)], quantile=0)
