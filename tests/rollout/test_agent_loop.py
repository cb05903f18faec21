"""The agent loop: exact token bookkeeping, Table 6 limits, parser errors, concurrency, and sources out of it."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from fakes import RecordingAttempt, ScriptedEngine

from tslightning.rollout.action_parser import PARSER_ERROR_OBSERVATION, Finish, ParseError, ShellCommand
from tslightning.rollout.agent_loop import AgentLimits, AgentLoop, PromptTooLong
from tslightning.rollout.observation import ObservationWindow


def run(loop, attempt, trajectory=0, on_turn=None):
    return asyncio.run(loop.run("task-a", "Count lines in data.txt", attempt, "g0", trajectory, 0, on_turn))


def test_tokens_are_prompt_then_engine_ids_then_observations(tokenizer):
    engine = ScriptedEngine(tokenizer, {0: ["<bash>ls</bash>", "ok <finish/>"]})
    attempt = RecordingAttempt()
    trajectory = run(AgentLoop(engine, tokenizer), attempt)
    assert attempt.commands == ["ls"] and trajectory.end_reason == "finished" and trajectory.reward == 1.0
    first, second = trajectory.turns
    assert isinstance(first.action, ShellCommand) and isinstance(second.action, Finish)
    # The second request's context is exactly prompt + first action ids + first observation ids.
    expected_context = (
        list(trajectory.prompt_token_ids) + list(first.action_token_ids) + list(first.observation_token_ids)
    )
    assert list(engine.requests[1].prompt_token_ids) == expected_context
    ids, mask = trajectory.token_ids(), trajectory.scored_mask()
    assert ids.tolist() == expected_context + list(second.action_token_ids) + list(second.observation_token_ids)
    assert ids[mask].tolist() == list(first.action_token_ids) + list(second.action_token_ids)
    assert "file.txt" in tokenizer.decode(list(first.observation_token_ids))
    source = trajectory.trajectory_source()
    assert source.prompt_length == len(trajectory.prompt_token_ids) and source.reward == 1.0


def test_turn_sources_are_prefixes_with_one_scored_turn(tokenizer):
    engine = ScriptedEngine(tokenizer, {0: ["<bash>ls</bash>", "<bash>wc -l data.txt</bash>", "<finish/>"]})
    seen = []
    trajectory = run(AgentLoop(engine, tokenizer), RecordingAttempt(), on_turn=lambda t, turn: seen.append(turn.index))
    assert seen == [0, 1, 2]  # each turn announced as soon as its action was fixed
    full = trajectory.token_ids()
    for j, turn in enumerate(trajectory.turns):
        teacher = torch.full((len(turn.action_token_ids),), -0.5)
        source = trajectory.turn_source(j, teacher)
        assert torch.equal(source.token_ids, full[: len(source.token_ids)])  # realized causal history
        assert source.token_ids[source.scored_mask].tolist() == list(turn.action_token_ids)
        assert len(source.token_ids) == turn.context_length + len(turn.action_token_ids)


def test_unparsable_action_consumes_the_turn_with_fixed_observation(tokenizer):
    engine = ScriptedEngine(tokenizer, {0: ["I think I should look", "<finish/>"]})
    attempt = RecordingAttempt()
    trajectory = run(AgentLoop(engine, tokenizer), attempt)
    assert isinstance(trajectory.turns[0].action, ParseError) and attempt.commands == []
    assert PARSER_ERROR_OBSERVATION in tokenizer.decode(list(trajectory.turns[0].observation_token_ids))
    assert len(trajectory.turns) == 2


def test_max_turns_ends_cleanly(tokenizer):
    engine = ScriptedEngine(tokenizer, {0: ["<bash>ls</bash>"]})
    trajectory = run(AgentLoop(engine, tokenizer, AgentLimits(max_turns=3)), RecordingAttempt(reward=0.0))
    assert len(trajectory.turns) == 3 and trajectory.end_reason == "max_turns" and trajectory.reward == 0.0


def test_trajectory_token_budget_caps_each_request(tokenizer):
    limits = AgentLimits(max_tokens_per_turn=50, max_tokens_per_trajectory=12)
    engine = ScriptedEngine(tokenizer, {0: ["<bash>echo one two three four five</bash>"]}, length_cut=True)
    trajectory = run(AgentLoop(engine, tokenizer, limits), RecordingAttempt())
    assert sum(len(t.action_token_ids) for t in trajectory.turns) <= 12
    assert all(r.max_tokens <= 12 for r in engine.requests)
    assert trajectory.end_reason == "trajectory_token_limit"
    # A turn cut by max_tokens is closed with the end-of-turn token, as unscored context.
    cut = trajectory.turns[0]
    assert cut.finish_reason == "length" and cut.observation_token_ids[0] == tokenizer.eos_token_id


def test_long_observation_keeps_head_and_tail(tokenizer):
    limits = AgentLimits(observation=ObservationWindow(head_tokens=8, tail_tokens=8))
    engine = ScriptedEngine(tokenizer, {0: ["<bash>cat big</bash>", "<finish/>"]})
    output = "HEADSTART " + "x " * 500 + " TAILEND"
    trajectory = run(AgentLoop(engine, tokenizer, limits), RecordingAttempt(output=output))
    text = tokenizer.decode(list(trajectory.turns[0].observation_token_ids))
    assert "HEAD" in text and "TAILEND" in text and "tokens omitted" in text and text.count("x") < 40


def test_context_limit_ends_without_appending_the_observation(tokenizer):
    loop = AgentLoop(ScriptedEngine(tokenizer, {0: ["<bash>cat big</bash>"]}), tokenizer)
    prompt = len(loop.prompt_token_ids("Count lines in data.txt"))
    limits = AgentLimits(max_prompt_tokens=prompt, max_context_tokens=prompt + 40)
    engine = ScriptedEngine(tokenizer, {0: ["<bash>cat big</bash>"]})
    trajectory = run(AgentLoop(engine, tokenizer, limits), RecordingAttempt(output="y " * 200))
    assert trajectory.end_reason == "context_limit"
    assert len(trajectory.token_ids()) <= prompt + 40


def test_prompt_over_limit_is_rejected_not_truncated(tokenizer):
    loop = AgentLoop(ScriptedEngine(tokenizer, {0: ["<finish/>"]}), tokenizer, AgentLimits(max_prompt_tokens=5))
    with pytest.raises(PromptTooLong, match="max_prompt_tokens"):
        run(loop, RecordingAttempt())


def test_seeds_depend_on_identity_not_arrival(tokenizer):
    engine = ScriptedEngine(tokenizer, {0: ["<bash>ls</bash>", "<finish/>"], 1: ["<finish/>"]})
    loop = AgentLoop(engine, tokenizer, run_seed=7)
    run(loop, RecordingAttempt(), trajectory=1)
    run(loop, RecordingAttempt(), trajectory=0)
    seeds = {r.request_id: r.seed for r in engine.requests}
    again = ScriptedEngine(tokenizer, {0: ["<bash>ls</bash>", "<finish/>"], 1: ["<finish/>"]})
    loop2 = AgentLoop(again, tokenizer, run_seed=7)
    run(loop2, RecordingAttempt(), trajectory=0)
    run(loop2, RecordingAttempt(), trajectory=1)
    assert seeds == {r.request_id: r.seed for r in again.requests}
    assert len(set(seeds.values())) == len(seeds)


def test_a_slow_tool_does_not_block_other_trajectories(tokenizer):
    """Trajectory 0 waits 1 s on its tool; trajectory 1 finishes meanwhile; tools run off the event loop."""
    engine = ScriptedEngine(tokenizer, {0: ["<bash>sleep</bash>", "<finish/>"], 1: ["<finish/>"]})
    loop = AgentLoop(engine, tokenizer)
    slow, fast = RecordingAttempt(delay=1.0), RecordingAttempt()
    finished = []

    async def both():
        async def one(attempt, index):
            trajectory = await loop.run("t", "do it", attempt, "g", index, 0)
            finished.append((index, time.perf_counter()))
            return trajectory

        return await asyncio.gather(one(slow, 0), one(fast, 1))

    start = time.perf_counter()
    asyncio.run(both())
    assert [index for index, _ in finished] == [1, 0]
    assert finished[0][1] - start < 0.5
    assert "MainThread" not in slow.threads


def test_speculative_generations_keep_their_counts_and_no_log_probs(tokenizer):
    import dataclasses

    from tslightning.rollout.speculative import SpeculationStats

    class SpeculatingEngine(ScriptedEngine):
        def submit(self, request):
            generation = super().submit(request).result()
            future = type(super().submit(request))()
            future.set_result(dataclasses.replace(generation, logprobs=None, speculation=SpeculationStats(2, 8, 5)))
            return future

    engine = SpeculatingEngine(tokenizer, {0: ["<bash>ls</bash>", "<finish/>"]})
    trajectory = run(AgentLoop(engine, tokenizer), RecordingAttempt())
    assert all(turn.action_logprobs is None for turn in trajectory.turns)
    record = trajectory.generation_record()
    assert record["spec_steps"] == 4 and record["spec_drafted"] == 16 and record["spec_accepted"] == 10
    assert record["generated_tokens"] == sum(len(t.action_token_ids) for t in trajectory.turns)
    assert trajectory.generation_record(1)["spec_steps"] == 2
    trajectory.teacher_logprobs[0] = torch.zeros(len(trajectory.turns[0].action_token_ids))
    assert trajectory.teacher_gap() == (0.0, 0)  # untrusted engine log-probs count nothing
    plain = run(AgentLoop(ScriptedEngine(tokenizer, {0: ["<finish/>"]}), tokenizer), RecordingAttempt())
    assert plain.generation_record()["spec_steps"] is None
