"""Observations keep head and tail tokens (Table 6) and say how a command ended."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tslightning.rollout.observation import ObservationWindow, keep_head_and_tail, status_line


def marker(omitted):
    return [-1, omitted]


def test_short_output_is_untouched():
    assert keep_head_and_tail(list(range(10)), ObservationWindow(5, 5), marker) == (list(range(10)), 0)


def test_long_output_keeps_head_and_tail_exactly():
    kept, omitted = keep_head_and_tail(list(range(100)), ObservationWindow(3, 4), marker)
    assert kept == [0, 1, 2, -1, 93, 96, 97, 98, 99] and omitted == 93


@given(st.lists(st.integers(0, 1000), max_size=300), st.integers(0, 50), st.integers(0, 50))
def test_window_property(ids, head, tail):
    kept, omitted = keep_head_and_tail(ids, ObservationWindow(head, tail), marker)
    if omitted == 0:
        assert kept == ids
    else:
        assert omitted == len(ids) - head - tail
        assert kept[:head] == ids[:head] and kept[head : head + 2] == [-1, omitted]
        assert kept[head + 2 :] == ids[len(ids) - tail :]


def test_negative_window_rejected():
    with pytest.raises(ValueError, match="head_tokens"):
        ObservationWindow(-1, 3)


def test_status_lines():
    assert status_line(0, False, None) == "[exit code 0]"
    assert "timed out" in status_line(None, True, "timeout")
    assert status_line(137, False, "memory") == "[exit code 137] [limit hit: memory]"
