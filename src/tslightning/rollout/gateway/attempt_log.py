"""An attempt's logs: every call the gateway answered or refused and every command the harness ran in the sandbox.

One directory per attempt (``<log dir>/update-<k>/<group>/<trajectory>/``, the group id's ``/`` written as ``_``):
``calls.jsonl`` (turn, segment, policy version, prompt token counts, the sampled ids and their log-probs, the
finish reason),
``commands.jsonl`` (the command as run in the attempt's sandbox, exit code, limits hit, seconds, the output's tail),
``refusals.jsonl`` (the code and message of each refused call) and ``harness.log`` (the harness process's output).
Without a directory nothing is written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["AttemptLog", "attempt_log_dir"]

OUTPUT_TAIL_CHARS = 2000
"""Characters of a command's output kept in ``commands.jsonl`` (the sandbox already bounds what it returns)."""


def attempt_log_dir(root: Path, update: int, group_id: str, trajectory_index: int) -> Path:
    """Where attempt ``(group_id, trajectory_index)`` of update ``update`` logs under ``root``."""
    return root / f"update-{update}" / group_id.replace("/", "_") / str(trajectory_index)


class AttemptLog:
    """Appends an attempt's records as JSON lines (thread-safe); ``directory=None`` writes nothing."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    @property
    def harness_output(self) -> Path | None:
        """The file the harness process's stdout and stderr go to."""
        return None if self.directory is None else self.directory / "harness.log"

    def call(self, trajectory, turn, continuation, seconds: float) -> None:
        self._append(
            "calls.jsonl",
            {
                "turn": turn.index,
                "segment": trajectory.segments - 1,
                "new_segment": continuation.new_segment,
                "policy_version": turn.policy_version,
                "prompt_tokens": len(continuation.prompt_ids),
                "new_prompt_tokens": len(continuation.new_ids),
                "sampled_ids": list(turn.action_token_ids),
                "logprobs": None if turn.action_logprobs is None else list(turn.action_logprobs),
                "finish_reason": turn.finish_reason,
                "seconds": round(seconds, 4),
            },
        )

    def command(self, command: str, outcome, seconds: float) -> None:
        output = outcome.output or ""
        self._append(
            "commands.jsonl",
            {
                "command": command,
                "exit_code": outcome.exit_code,
                "timed_out": outcome.timed_out,
                "limit_hit": outcome.limit_hit,
                "seconds": round(seconds, 4),
                "output_tail": output[-OUTPUT_TAIL_CHARS:],
            },
        )

    def refusal(self, code: str, message: str) -> None:
        self._append("refusals.jsonl", {"code": code, "message": message})

    def _append(self, name: str, record: dict[str, Any]) -> None:
        if self.directory is None:
            return
        line = json.dumps({"time": time.time(), **record}) + "\n"
        with self._lock, (self.directory / name).open("a") as file:
            file.write(line)
