"""A harness process per attempt (our scripted one, the plain ``openai`` client): its calls become the trajectory, its
command runs in the attempt, the verifier gives the reward; a rewriting harness is cut as documented (GRPO ends the
attempt, OPD scores each segment under its own context, through the rollout DataModule); a harness that never
calls, or overruns its time, is reported and ended with its process group."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
from gateway_fakes import CharacterEngine, RecordingAttempt, character_ids

from tslightning.core.sources import TrajectoryClosed, TurnSource
from tslightning.rollout.agent_loop import AgentLimits
from tslightning.rollout.gateway import OpenAIGateway
from tslightning.rollout.harness import HarnessAgent, HarnessError, HarnessProgram
from tslightning.rollout.rollout_datamodule import RolloutDataModule

SCRIPTED = [sys.executable, str(Path(__file__).with_name("scripted_harness.py"))]
LIMITS = AgentLimits(max_turns=4, max_tokens_per_turn=32, max_tokens_per_trajectory=96, max_prompt_tokens=300,
                     max_context_tokens=600)  # fmt: skip


def _agent(tokenizer, program: HarnessProgram, log_dir=None, allow_segments=True, reply="ls -l"):
    engine = CharacterEngine(tokenizer, lambda request: reply)
    gateway = OpenAIGateway(engine, tokenizer, LIMITS, run_seed=3, allow_segments=allow_segments).start()
    return HarnessAgent(gateway, program, log_dir), engine


def test_a_harness_attempt_is_a_trajectory_of_its_calls_with_the_verifiers_reward(tokenizer, tmp_path):
    agent, engine = _agent(tokenizer, HarnessProgram(SCRIPTED, timeout_s=120), tmp_path)
    attempt = RecordingAttempt(output="/app\n", reward=0.75)
    seen = []

    async def run():
        def on_turn(trajectory, turn):
            seen.append((turn.index, threading.current_thread() is loop_thread))

        loop_thread = threading.current_thread()
        return await agent.run("count", "Count the lines.\n", attempt, "u0/p0/count", 1, 0, on_turn)

    try:
        trajectory = asyncio.run(run())
    finally:
        agent.close()

    assert attempt.commands == ["pwd; ls /; echo written > /app/harness-was-here.txt"]
    assert trajectory.reward == 0.75 and trajectory.end_reason == "finished"
    assert seen == [(0, True), (1, True)]  # each turn reported on the attempt's own loop, as it was answered
    sampled = character_ids(tokenizer, "ls -l") + [tokenizer.eos_token_id]
    source = trajectory.trajectory_source()
    assert source.token_ids[source.scored_mask].tolist() == sampled * 2  # the sampled ids, never re-tokenized
    assert tokenizer.encode("ls -l", add_special_tokens=False) != sampled[:-1]
    seeds = [request.seed for request in engine.requests]
    assert len(set(seeds)) == 2 and engine.requests[0].session == "u0/p0/count/1"
    logs = tmp_path / "update-0" / "u0_p0_count" / "1"
    assert {p.name for p in logs.iterdir()} >= {"calls.jsonl", "commands.jsonl", "harness.log"}


def test_a_harness_command_runs_in_the_tasks_sandbox_and_its_verifier_rewards_the_attempt(tokenizer, tmp_path):
    """A real attempt (bubblewrap, the shipped count-lines task): the command runs in /app of the task's sandbox,
    never in the harness's directory on the host, and the task's own verifier scores what it left."""
    from tslightning.tasks.task_attempt import TerminalTaskAttempt
    from tslightning.tasks.terminal_task import TerminalTask
    from tslightning.tasks.validation import library_dir

    command = "cat log.txt | wc -l > count.txt; pwd; ls /"
    program = HarnessProgram(SCRIPTED, environment={"SCRIPTED_COMMAND": command}, timeout_s=120)
    agent, _ = _agent(tokenizer, program, tmp_path)
    task = TerminalTask.load(library_dir() / "count-lines")
    try:
        with TerminalTaskAttempt(task, command_timeout_s=20) as attempt:
            trajectory = asyncio.run(agent.run("count-lines", task.instruction, attempt, "g", 0, 0))
            verdict = attempt.verification
    finally:
        agent.close()
    logs = tmp_path / "update-0" / "g" / "0"
    (ran,) = [json.loads(line) for line in (logs / "commands.jsonl").read_text().splitlines()]
    assert ran["command"] == command and ran["exit_code"] == 0
    assert ran["output_tail"].startswith("/app\n") and "home" not in ran["output_tail"].split()  # the sandbox's root
    assert not (logs / "count.txt").exists()  # not run where the harness runs
    assert trajectory.reward == verdict.reward > 0 and verdict.passed_fraction == 1.0


def test_a_rewriting_harness_gives_a_grpo_source_of_one_sequence_per_segment(tokenizer):
    program = HarnessProgram(SCRIPTED, environment={"SCRIPTED_REWRITE": "1"}, timeout_s=120)
    agent, engine = _agent(tokenizer, program)
    try:
        trajectory = asyncio.run(agent.run("t", "Do it.", RecordingAttempt(), "g", 0, 0))
    finally:
        agent.close()
    trajectory.reward = 1.0
    source = trajectory.trajectory_source()
    assert trajectory.segment_starts == [0, 1] and len(source.segments) == 1
    sampled = character_ids(tokenizer, "ls -l") + [tokenizer.eos_token_id]
    for (ids, mask), request in zip(source.sequences, engine.requests, strict=True):
        # each sequence is the prompt the server saw for its segment, then the ids it sampled there
        assert ids[: len(request.prompt_token_ids)].tolist() == list(request.prompt_token_ids)
        assert ids[mask].tolist() == sampled
    assert source.num_scored == 2 * len(sampled) and source.prompt_length == len(engine.requests[0].prompt_token_ids)


def test_a_gateway_that_takes_one_segment_ends_the_attempt_at_the_rewrite(tokenizer):
    program = HarnessProgram(SCRIPTED, environment={"SCRIPTED_REWRITE": "1"}, timeout_s=120)
    agent, _ = _agent(tokenizer, program, allow_segments=False)
    try:
        trajectory = asyncio.run(agent.run("t", "Do it.", RecordingAttempt(), "g", 0, 0))
    finally:
        agent.close()
    assert trajectory.end_reason == "history_rewritten" and len(trajectory.turns) == 1
    assert trajectory.trajectory_source().num_scored == len("ls -l") + 1


class _Teacher:
    """Scores every action token -1.0, recording the histories it was asked to score."""

    def __init__(self) -> None:
        self.histories: list[list[int]] = []

    def submit(self, token_ids: torch.Tensor, mask: torch.Tensor) -> Future:
        self.histories.append(token_ids.tolist())
        future: Future = Future()
        future.set_result(torch.full((int(mask.sum()),), -1.0))
        return future


def test_opd_scores_each_segment_of_a_rewriting_harness_under_its_own_context(tokenizer):
    program = HarnessProgram(SCRIPTED, environment={"SCRIPTED_REWRITE": "1"}, timeout_s=120)
    agent, engine = _agent(tokenizer, program, allow_segments=True)
    teacher = _Teacher()
    task = type("Task", (), {"task_id": "t", "instruction": "Do it."})()
    datamodule = RolloutDataModule(
        engine, tokenizer, [task], lambda task: _Opened(RecordingAttempt()), "opd", 1, 1, LIMITS, teacher, agent=agent
    )
    try:
        items = list(datamodule.stream_update(0))
    finally:
        agent.close()
    turns = [item for item in items if isinstance(item, TurnSource)]
    assert [t.turn_index for t in sorted(turns, key=lambda t: t.turn_index)] == [0, 1]
    assert any(isinstance(item, TrajectoryClosed) and item.num_turn_sources == 2 for item in items)
    trajectory = datamodule.trajectories[0][0]
    assert trajectory.segment_starts == [0, 1]
    sampled = character_ids(tokenizer, "ls -l") + [tokenizer.eos_token_id]
    for turn in turns:  # each turn's history is the prompt the server saw, then its sampled ids
        request = engine.requests[turn.turn_index]
        assert turn.token_ids.tolist() == [*request.prompt_token_ids, *sampled]
        assert turn.token_ids[turn.scored_mask].tolist() == sampled
    assert sorted(map(len, teacher.histories)) == sorted(len(t.token_ids) for t in turns)


class _Opened:
    def __init__(self, attempt) -> None:
        self.attempt = attempt

    def __enter__(self):
        return self.attempt

    def __exit__(self, *exc_info) -> None:
        pass


def test_a_harness_that_never_calls_the_model_fails_the_attempt_with_its_output(tokenizer, tmp_path):
    program = HarnessProgram([sys.executable, "-c", "import sys; print('no model configured'); sys.exit(3)"])
    agent, _ = _agent(tokenizer, program, tmp_path)
    try:
        with pytest.raises(HarnessError, match="exited with status 3 before its first model call") as failed:
            asyncio.run(agent.run("t", "Do it.", RecordingAttempt(), "g", 0, 0))
    finally:
        agent.close()
    assert "no model configured" in str(failed.value) and "harness.log" in str(failed.value)


HANGS = """
import os, subprocess, openai
pid = subprocess.Popen(["sleep", "300"]).pid
open("child.pid", "w").write(str(pid))
openai.OpenAI(max_retries=0).chat.completions.create(model=os.environ["TSLIGHTNING_MODEL"],
    messages=[{"role": "user", "content": "hi"}])
import time; time.sleep(300)
"""


def test_a_harness_over_its_time_is_ended_with_everything_it_started(tokenizer, tmp_path):
    agent, _ = _agent(tokenizer, HarnessProgram([sys.executable, "-c", HANGS], timeout_s=8), tmp_path)
    start = time.monotonic()
    try:
        trajectory = asyncio.run(agent.run("t", "Do it.", RecordingAttempt(), "g", 0, 0))
    finally:
        agent.close()
    assert trajectory.end_reason == "harness_timeout" and len(trajectory.turns) == 1
    assert time.monotonic() - start < 30
    child = int((tmp_path / "update-0" / "g" / "0" / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
