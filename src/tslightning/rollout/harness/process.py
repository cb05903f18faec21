"""One harness process per attempt: the program, what it is told, how long it may run.

A harness is any program that acts through an OpenAI-compatible API. It is started once per attempt, in its own
process group, with its attempt's connection in the environment — the variables OpenAI's and litellm's clients read
by default, plus tslightning's:

=============================== ==============================================================================
``OPENAI_BASE_URL``             ``http://127.0.0.1:<port>/v1`` (also as ``OPENAI_API_BASE``)
``OPENAI_API_KEY``              the attempt's key (:mod:`~tslightning.rollout.gateway.attempt_sessions`)
``TSLIGHTNING_MODEL``           the model id to name in calls
``TSLIGHTNING_COMMAND_URL``     ``POST`` a ``{"command": ...}`` here (with the key) to run it in the attempt's sandbox
``TSLIGHTNING_INSTRUCTION_FILE`` the task's instruction
``TSLIGHTNING_MAX_TURNS``       calls the attempt answers (a harness may use it as its step limit)
=============================== ==============================================================================

It inherits the trainer's environment but for the learner rank's torch.distributed variables. Its working
directory is the attempt's log directory (or a temporary one), its stdout and stderr go to
``harness.log`` there. It is ended — its whole process group — when it exceeds ``timeout_s``. Nothing it prints or
returns decides the reward: the trainer runs the task's verifier after it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tslightning.distributed.rank_placement import LEARNER_RANK_VARIABLES

__all__ = ["HarnessConnection", "HarnessExit", "HarnessProgram"]

KILL_GRACE_S = 5.0
"""Seconds between SIGTERM and SIGKILL for a harness that overran its time."""


@dataclass(frozen=True)
class HarnessConnection:
    """What one attempt's harness needs to reach the gateway."""

    base_url: str
    key: str
    model: str
    max_turns: int

    def environment(self, instruction_file: Path) -> dict[str, str]:
        gateway = self.base_url.removesuffix("/v1")
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_BASE": self.base_url,
            "OPENAI_API_KEY": self.key,
            "TSLIGHTNING_MODEL": self.model,
            "TSLIGHTNING_COMMAND_URL": f"{gateway}/tslightning/v1/commands",
            "TSLIGHTNING_INSTRUCTION_FILE": str(instruction_file),
            "TSLIGHTNING_MAX_TURNS": str(self.max_turns),
        }


@dataclass(frozen=True)
class HarnessExit:
    """How a harness process ended: its exit status (``None`` if it was killed for time) and its output's tail."""

    returncode: int | None
    timed_out: bool
    output_tail: str


@dataclass(frozen=True)
class HarnessProgram:
    """The program run per attempt.

    Attributes:
        command: Its command line.
        environment: Variables added to the trainer's environment (before the connection's).
        timeout_s: Wall-clock seconds one attempt's harness may run.
    """

    command: Sequence[str]
    environment: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 900.0

    async def run(self, connection: HarnessConnection, instruction: str, directory: Path | None) -> HarnessExit:
        """Run the harness for one attempt to its end (or its time limit); returns how it ended."""
        with contextlib.ExitStack() as stack:
            if directory is None:
                directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tsl-harness-")))
            directory.mkdir(parents=True, exist_ok=True)
            instruction_file = directory / "instruction.md"
            instruction_file.write_text(instruction)
            inherited = {k: v for k, v in os.environ.items() if k not in LEARNER_RANK_VARIABLES}
            environment = {**inherited, **self.environment, **connection.environment(instruction_file)}
            output = directory / "harness.log"
            with output.open("ab") as log:
                process = await asyncio.create_subprocess_exec(
                    *self.command,
                    cwd=directory,
                    env=environment,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,  # its own process group: ended whole
                )
                timed_out = await _wait(process, self.timeout_s)
            with contextlib.suppress(ProcessLookupError):  # what it left running in its group ends with it
                os.killpg(process.pid, signal.SIGKILL)
            return HarnessExit(None if timed_out else process.returncode, timed_out, _tail(output))


async def _wait(process: asyncio.subprocess.Process, timeout_s: float) -> bool:
    """Wait for ``process``; past ``timeout_s`` (or when cancelled) end its process group. True if it timed out."""
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
        return False
    except TimeoutError:
        await _end(process)
        return True
    except BaseException:
        await _end(process)
        raise


async def _end(process: asyncio.subprocess.Process) -> None:
    for sent in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sent)
        try:
            await asyncio.wait_for(process.wait(), KILL_GRACE_S)
            return
        except TimeoutError:
            continue


def _tail(path: Path, chars: int = 3000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-chars:]
    return ""
