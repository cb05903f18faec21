"""The agent's action format: one shell command per turn, inside the assistant message (Table 6).

An assistant turn may think aloud, then must contain exactly one of::

    <bash>COMMAND</bash>     run COMMAND in the task's sandbox; its output is the next observation
    <finish/>                the attempt is done; the verifier runs

Anything else — no action, two actions, an empty or unterminated command — is unparsable: the turn is consumed and
the fixed :data:`PARSER_ERROR_OBSERVATION` is returned as its observation (App. D.2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PARSER_ERROR_OBSERVATION = (
    "Parser error: reply with exactly one <bash>COMMAND</bash> block to run a shell command, "
    "or <finish/> when the task is done."
)
"""The fixed observation an unparsable action receives."""

ACTION_FORMAT_PROMPT = (
    "You are working in a Linux shell in /app. Each reply must contain exactly one action: "
    "<bash>COMMAND</bash> to run a shell command (you will see its output), or <finish/> when the task is done."
)
"""System prompt that documents the action format to the policy."""

_BASH = re.compile(r"<bash>(.*?)</bash>", re.DOTALL)
_FINISH = re.compile(r"<finish\s*/>")
_OPEN_TAG = re.compile(r"<bash>")


@dataclass(frozen=True)
class ShellCommand:
    """Run ``command`` in the sandbox."""

    command: str


@dataclass(frozen=True)
class Finish:
    """End the attempt; the verifier decides the reward."""


@dataclass(frozen=True)
class ParseError:
    """The turn had no single valid action; ``reason`` says why (for logs, never shown to the policy)."""

    reason: str


Action = ShellCommand | Finish | ParseError


def parse_action(text: str) -> Action:
    """Parse one assistant turn's decoded text into an action; never raises."""
    commands = _BASH.findall(text)
    finishes = len(_FINISH.findall(text))
    opened = len(_OPEN_TAG.findall(text))
    if opened != len(commands):
        return ParseError("unterminated <bash> block")
    if len(commands) + finishes == 0:
        return ParseError("no action")
    if len(commands) + finishes > 1:
        return ParseError(f"{len(commands) + finishes} actions in one turn; at most one tool call per turn")
    if finishes:
        return Finish()
    command = commands[0].strip()
    if not command:
        return ParseError("empty command")
    return ShellCommand(command)
