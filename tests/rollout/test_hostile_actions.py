"""Hostile ``<bash>`` actions through the agent loop and the rollout DataModule, with real sandboxed attempts: each
becomes an observation, the verifier still scores the attempt, the update closes, and no attempt directory is left.
"""

from __future__ import annotations

import asyncio
import contextlib

from fakes import ScriptedEngine

from tslightning.core.sources import BatchClosed, TrajectorySource
from tslightning.rollout.agent_loop import AgentLimits, AgentLoop
from tslightning.rollout.observation import MIN_WINDOW_CHARS, ObservationWindow
from tslightning.rollout.rollout_datamodule import RolloutDataModule
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import library_dir

DEEP_TREE = "python3 -c \"import os\nfor _ in range(1500): os.mkdir('d'); os.chdir('d')\""
HOSTILE_TURNS = [
    "<bash>printf 'a\0b' > nul.txt</bash>",  # a NUL byte in the command
    "<bash>head -c 3000000 /dev/zero | tr '\\0' a; echo TAIL</bash>",  # a flood: about 1 MiB is kept
    f"<bash>{DEEP_TREE}</bash>",  # 1500 nested directories in /app
    "<bash>wc -l < log.txt > count.txt</bash>",  # then the task's solution
    "<finish/>",
]
LIMITS = AgentLimits(max_turns=8, max_tokens_per_turn=256, max_tokens_per_trajectory=2048)


class CountingTokenizer:
    """The policy's tokenizer, recording the longest text it was asked to encode."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.longest = 0

    def encode(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self._tokenizer.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


class RecordingFactory:
    """Opens real ``TerminalTaskAttempt``s and remembers their directories."""

    def __init__(self) -> None:
        self.roots = []

    @contextlib.contextmanager
    def __call__(self, task):
        with TerminalTaskAttempt(task, command_timeout_s=30) as attempt:
            self.roots.append(attempt.attempt.root)
            yield attempt


def test_hostile_actions_become_observations_and_the_attempt_is_still_scored(tokenizer):
    counting = CountingTokenizer(tokenizer)
    task = TerminalTask.load(library_dir() / "count-lines")
    loop = AgentLoop(ScriptedEngine(tokenizer, {0: HOSTILE_TURNS}), counting, LIMITS)
    factory = RecordingFactory()
    with factory(task) as attempt:
        trajectory = asyncio.run(loop.run(task.task_id, task.instruction, attempt, "g0", 0, 0))
    assert trajectory.end_reason == "finished" and trajectory.reward == 1.5
    nul, flood, deep = (tokenizer.decode(list(turn.observation_token_ids)) for turn in trajectory.turns[:3])
    assert "NUL character" in nul and "[exit code 2]" in nul
    window = LIMITS.observation
    assert "characters and" in flood and "tokens omitted" in flood and "TAIL" in flood
    assert (
        len(trajectory.turns[1].observation_token_ids) < window.head_tokens + window.tail_tokens + 128
    )  # + marker, status, headers
    assert "[exit code 0]" in deep
    # The 1 MiB output was never tokenized whole: only windows of its head and tail (plus the prompt).
    assert counting.longest <= 2 * max(MIN_WINDOW_CHARS, 8 * window.head_tokens)
    assert not factory.roots[0].exists()


def test_the_rollout_datamodule_closes_the_update_with_hostile_attempts(tokenizer):
    task = TerminalTask.load(library_dir() / "count-lines")
    factory = RecordingFactory()
    limits = AgentLimits(
        max_turns=8,
        max_tokens_per_turn=256,
        max_tokens_per_trajectory=2048,
        observation=ObservationWindow(head_tokens=64, tail_tokens=64),
    )
    datamodule = RolloutDataModule(
        ScriptedEngine(tokenizer, {0: HOSTILE_TURNS, 1: HOSTILE_TURNS[:1] + HOSTILE_TURNS[2:]}),
        tokenizer,
        [task],
        factory,
        "grpo",
        prompts_per_update=1,
        samples_per_prompt=2,
        limits=limits,
        max_concurrent_attempts=2,
    )
    items = list(datamodule.stream_update(0))
    sources = [item for item in items if isinstance(item, TrajectorySource)]
    assert isinstance(items[-1], BatchClosed) and sorted(source.reward for source in sources) == [1.5, 1.5]
    assert len(factory.roots) == 2 and not any(root.exists() for root in factory.roots)
