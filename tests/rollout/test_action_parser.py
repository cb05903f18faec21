"""The action format: one tool call per turn; anything else is a parser error, and the parser never crashes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tslightning.rollout.action_parser import Finish, ParseError, ShellCommand, parse_action


def test_single_command_with_reasoning():
    assert parse_action("Let me look.\n<bash>ls -la /app</bash>") == ShellCommand("ls -la /app")


def test_multiline_command_is_kept_whole():
    assert parse_action("<bash>\ncd /app\nwc -l data.txt\n</bash>") == ShellCommand("cd /app\nwc -l data.txt")


def test_finish():
    assert parse_action("All done. <finish/>") == Finish()
    assert parse_action("<finish />") == Finish()


def test_unparsable_turns():
    for text, reason in [
        ("I will list files", "no action"),
        ("<bash>ls</bash><bash>pwd</bash>", "2 actions"),
        ("<bash>ls</bash> <finish/>", "2 actions"),
        ("<bash>   </bash>", "empty command"),
        ("<bash>ls -la", "unterminated"),
        ("", "no action"),
    ]:
        result = parse_action(text)
        assert isinstance(result, ParseError) and reason in result.reason, (text, result)


PIECES = st.sampled_from(["<", ">", "/", "b", "ash", "finish", " ", "ls", "\n", "-", "<bash>", "</bash>", "<finish/>"])


@settings(max_examples=500, deadline=None)
@given(st.lists(PIECES, max_size=30).map("".join))
def test_parser_never_crashes_on_tag_soup(text):
    result = parse_action(text)
    assert isinstance(result, ShellCommand | Finish | ParseError)
    if isinstance(result, ShellCommand):
        assert result.command and result.command == result.command.strip()


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_parser_never_crashes_on_arbitrary_text(text):
    assert isinstance(parse_action(text), ShellCommand | Finish | ParseError)
