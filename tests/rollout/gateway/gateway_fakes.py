"""Test doubles for the gateway: an engine that samples chosen ids (one character token each), and a recording
attempt."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass

from tslightning.rollout.engine import Generation, GenerationRequest


def character_ids(tokenizer, text: str) -> list[int]:
    """``text`` as one token per character: ids the tokenizer would never produce for it (it merges them)."""
    return [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(character)[0]) for character in text]


class CharacterEngine:
    """Samples ``reply(request)`` as one token per character (``canonical``: as the tokenizer encodes it), then the
    end-of-turn token (cut at ``max_tokens``); log-prob ``-0.5`` per token; stamps its :attr:`version`. ``hold`` (an
    Event) delays answers until set."""

    def __init__(
        self, tokenizer, reply=lambda request: "ok", version: int = 0, hold: threading.Event | None = None,
        canonical: bool = False,
    ):  # fmt: skip
        self.tokenizer, self.reply, self.version, self.hold = tokenizer, reply, version, hold
        self.canonical = canonical
        self.requests: list[GenerationRequest] = []

    @property
    def policy_version(self) -> int:
        return self.version

    def submit(self, request: GenerationRequest) -> Future:
        self.requests.append(request)
        text = self.reply(request)
        ids = (
            self.tokenizer.encode(text, add_special_tokens=False)
            if self.canonical
            else character_ids(self.tokenizer, text)
        )
        ids = ids + [self.tokenizer.eos_token_id]
        ids = ids[: request.max_tokens]
        reason = "stop" if ids[-1] == self.tokenizer.eos_token_id else "length"
        generation = Generation(request.request_id, tuple(ids), tuple([-0.5] * len(ids)), reason, self.version)
        future: Future = Future()
        if self.hold is None:
            future.set_result(generation)
        else:
            threading.Thread(target=lambda: (self.hold.wait(30), future.set_result(generation)), daemon=True).start()
        return future


@dataclass
class Outcome:
    output: str
    exit_code: int | None = 0
    timed_out: bool = False
    limit_hit: str | None = None


class RecordingAttempt:
    """Runs nothing: records each command and answers ``output``; ``verify`` returns ``reward``."""

    def __init__(self, output: str = "done\n", reward: float = 1.0) -> None:
        self.commands: list[str] = []
        self.output, self.reward = output, reward

    def run_command(self, command: str) -> Outcome:
        self.commands.append(command)
        return Outcome(self.output)

    def verify(self) -> float:
        return self.reward


class EchoAttempt(RecordingAttempt):
    """Answers ``echo TEXT`` with ``TEXT``, every other command with no output."""

    def run_command(self, command: str) -> Outcome:
        self.commands.append(command)
        return Outcome(command.removeprefix("echo ") + "\n" if command.startswith("echo ") else "")
