"""Observations keep head and tail tokens (Table 6) and say how a command ended."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tslightning.rollout.observation import (
    MIN_WINDOW_CHARS,
    WINDOW_MARGIN_TOKENS,
    ObservationWindow,
    keep_head_and_tail,
    keep_text_head_and_tail,
    status_line,
)


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


def _char_tokens(text):
    return [ord(c) for c in text]


def _text_marker(tokens, chars):
    return [-1, tokens, chars]


def test_a_long_text_is_tokenized_only_at_its_ends():
    seen = []

    def encode(text):
        seen.append(len(text))
        return _char_tokens(text)

    text = "H" * 10 + "m" * 1_000_000 + "T" * 10
    kept = keep_text_head_and_tail(text, ObservationWindow(5, 7), encode, _text_marker)
    assert kept[:5] == _char_tokens("HHHHH") and kept[-7:] == _char_tokens("TTTTTTT")
    assert kept[5] == -1 and kept[6] == 2 * MIN_WINDOW_CHARS - 12 and kept[7] == len(text) - 2 * MIN_WINDOW_CHARS
    assert max(seen) == MIN_WINDOW_CHARS


def test_a_text_within_the_windows_is_tokenized_whole_and_counted_exactly():
    text = "abcdefghij" * 10
    kept = keep_text_head_and_tail(text, ObservationWindow(3, 4), _char_tokens, _text_marker)
    assert kept == _char_tokens("abc") + [-1, 93, 0] + _char_tokens("ghij")


def test_windows_grow_until_they_hold_the_tokens():
    """A tokenizer with very long tokens (here: 5000 characters each) still fills the token window."""

    def coarse(text):
        return [len(text[i : i + 5000]) for i in range(0, len(text), 5000)]

    text = "x" * 5000 * 100
    kept = keep_text_head_and_tail(text, ObservationWindow(10, 0), coarse, _text_marker)
    assert kept[:10] == [5000] * 10 and kept[10] == -1 and len(kept) == 13
    assert kept[11] >= WINDOW_MARGIN_TOKENS
