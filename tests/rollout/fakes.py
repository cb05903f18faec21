"""Test doubles for the rollout side: a scripted engine and an in-memory attempt."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from tslightning.rollout.engine import Generation, GenerationRequest


class ScriptedEngine:
    """Answers each request with the next scripted reply for its trajectory, tokenized, logprob -1 per token."""

    def __init__(self, tokenizer, replies: dict[int, list[str]], version: int = 0, length_cut: bool = False):
        self.tokenizer, self.replies, self.version, self.length_cut = tokenizer, replies, version, length_cut
        self.requests: list[GenerationRequest] = []

    @property
    def policy_version(self) -> int:
        return self.version

    def submit(self, request: GenerationRequest) -> Future:
        self.requests.append(request)
        trajectory, turn = (int(x) for x in request.request_id.rsplit("/", 2)[-2:])
        text = self.replies[trajectory][min(turn, len(self.replies[trajectory]) - 1)]
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not self.length_cut:
            ids = ids + [self.tokenizer.eos_token_id]
        ids = ids[: request.max_tokens]
        stopped = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        future: Future = Future()
        future.set_result(
            Generation(
                request.request_id, tuple(ids), tuple([-1.0] * len(ids)), "stop" if stopped else "length", self.version
            )
        )
        return future


@dataclass
class Outcome:
    output: str
    exit_code: int | None = 0
    timed_out: bool = False
    limit_hit: str | None = None


class RecordingAttempt:
    def __init__(self, output: str = "file.txt", delay: float = 0.0, reward: float = 1.0):
        self.commands: list[str] = []
        self.output, self.delay, self.reward = output, delay, reward
        self.threads: set[str] = set()

    def run_command(self, command: str) -> Outcome:
        self.commands.append(command)
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        return Outcome(self.output)

    def verify(self) -> float:
        return self.reward
