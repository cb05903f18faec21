"""The gateway's API surface through the plain ``openai`` client: chat and text completions (also streamed), models,
log-probs, commands, and every refusal in OpenAI's format; the policy-version gate; exact sampled ids."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import requests
from gateway_fakes import CharacterEngine, RecordingAttempt, character_ids

from tslightning.rollout.agent_loop import AgentLimits
from tslightning.rollout.gateway import OpenAIGateway

MODEL = "tslightning-policy"
LIMITS = AgentLimits(max_turns=3, max_tokens_per_turn=32, max_tokens_per_trajectory=48, max_prompt_tokens=200,
                     max_context_tokens=400)  # fmt: skip
SYSTEM = {"role": "system", "content": "Reply with one command."}
USER = {"role": "user", "content": "List the files."}


@pytest.fixture
def served(tokenizer):
    """A started gateway on a :class:`CharacterEngine` answering "ls" (stopped)."""
    engine = CharacterEngine(tokenizer, lambda request: "ls")
    with OpenAIGateway(engine, tokenizer, LIMITS, run_seed=7, model_name=MODEL) as gateway:
        yield gateway, engine


def _client(gateway: OpenAIGateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=30)


def test_chat_completions_answer_the_sampled_reply_with_its_ids_version_and_usage(served, tokenizer):
    gateway, engine = served
    session = gateway.open_attempt("count", "u0/p0/count", 1, update=0)
    client = _client(gateway, session.key)

    reply = client.chat.completions.create(model=MODEL, messages=[SYSTEM, USER], logprobs=True)

    assert reply.choices[0].message.content == "ls" and reply.choices[0].finish_reason == "stop"
    assert reply.system_fingerprint == "tslightning-policy-v0"
    assert [entry.logprob for entry in reply.choices[0].logprobs.content] == [-0.5] * 3
    sampled = character_ids(tokenizer, "ls") + [tokenizer.eos_token_id]
    assert reply.model_extra["tslightning"]["token_ids"] == sampled
    prompt = tokenizer.apply_chat_template([SYSTEM, USER], add_generation_prompt=True, tokenize=False)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt)) and reply.usage.completion_tokens == 3
    request = engine.requests[0]
    assert request.temperature == 1.0 and request.stop_token_ids == (tokenizer.eos_token_id,)
    assert request.session == "u0/p0/count/1" and request.max_tokens == 32

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_streaming_text_completions_and_a_key_in_the_path(served, tokenizer):
    gateway, _ = served
    session = gateway.open_attempt("count", "g", 0, update=0)
    client = _client(gateway, session.key)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[SYSTEM, USER], stream=True,
                                                 stream_options={"include_usage": True}))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "ls"
    assert chunks[-1].usage.completion_tokens == 3

    raw = gateway.open_attempt("count", "g", 1, update=0)
    by_path = openai.OpenAI(base_url=f"{gateway.url}/attempts/{raw.key}/v1", api_key="unused", max_retries=0)
    text = by_path.completions.create(model=MODEL, prompt="$ ", max_tokens=2)
    assert text.choices[0].text == "ls" and text.choices[0].finish_reason == "length"
    again = by_path.completions.create(model=MODEL, prompt="$ ls\n$ ", max_tokens=2)  # the raw text continues
    assert again.choices[0].text == "ls" and raw.trajectory.segments == 1
    assert raw.trajectory.token_ids().tolist()[-4:] == [*tokenizer.encode("\n$ ", add_special_tokens=False),
                                                         *character_ids(tokenizer, "ls")][-4:]  # fmt: skip


def test_commands_run_in_the_attempt_and_are_logged(served, tmp_path):
    gateway, _ = served
    attempt = RecordingAttempt(output="a.txt\n")
    session = gateway.open_attempt("count", "g", 0, update=0, attempt=attempt, log_dir=tmp_path)
    url = f"{gateway.url}/tslightning/v1/commands"
    answer = requests.post(url, json={"command": "ls /app"}, headers={"Authorization": f"Bearer {session.key}"})
    assert answer.json() == {"output": "a.txt\n", "exit_code": 0, "timed_out": False, "limit_hit": None}
    assert attempt.commands == ["ls /app"]
    assert '"command": "ls /app"' in (tmp_path / "commands.jsonl").read_text()


def test_refusals_are_openai_errors_the_client_raises(served):
    gateway, _ = served
    unknown = _client(gateway, "tsl-nobody")
    with pytest.raises(openai.AuthenticationError) as refused:
        unknown.chat.completions.create(model=MODEL, messages=[SYSTEM, USER])
    assert refused.value.code == "invalid_api_key"

    session = gateway.open_attempt("count", "g", 0, update=0)
    client = _client(gateway, session.key)
    cases = [
        (openai.NotFoundError, "model_not_found", {"model": "gpt-4o"}),
        (openai.BadRequestError, "unsupported_parameter", {"temperature": 0.2}),
        (openai.BadRequestError, "unsupported_parameter", {"n": 2}),
        (openai.BadRequestError, "unsupported_parameter", {"stop": ["\n"]}),
        (openai.BadRequestError, "context_length_exceeded", {"messages": [{"role": "user", "content": "x " * 300}]}),
    ]
    for error, code, change in cases:
        with pytest.raises(error) as refused:
            client.chat.completions.create(**{"model": MODEL, "messages": [SYSTEM, USER], **change})
        assert refused.value.code == code, change
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[5, 10**6])
    assert refused.value.code == "invalid_value" and refused.value.param == "prompt"
    assert session.trajectory.turns == []  # nothing refused was sampled

    messages = [SYSTEM, USER]
    for _ in range(3):
        content = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content
        messages = [*messages, {"role": "assistant", "content": content}, {"role": "user", "content": "ok"}]
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages)
    assert refused.value.code == "turn_limit_exceeded" and session.end_reason == "max_turns"

    gateway.close_attempt(session)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client.chat.completions.create(model=MODEL, messages=[SYSTEM, USER])
    assert refused.value.code == "attempt_closed"


def test_the_trajectory_token_budget_caps_and_then_refuses(tokenizer):
    engine = CharacterEngine(tokenizer, lambda request: "x" * 40)
    with OpenAIGateway(engine, tokenizer, LIMITS, model_name=MODEL) as gateway:
        session = gateway.open_attempt("t", "g", 0, update=0)
        client = _client(gateway, session.key)
        first = client.chat.completions.create(model=MODEL, messages=[SYSTEM, USER], max_tokens=100)
        assert first.usage.completion_tokens == 32 and first.choices[0].finish_reason == "length"
        messages = [SYSTEM, USER, {"role": "assistant", "content": first.choices[0].message.content}, USER]
        second = client.chat.completions.create(model=MODEL, messages=messages)
        assert second.usage.completion_tokens == 16  # 48 per trajectory
        with pytest.raises(openai.PermissionDeniedError) as refused:
            client.chat.completions.create(model=MODEL, messages=messages)
        assert refused.value.code == "token_limit_exceeded"


def test_a_call_during_a_publication_waits_for_its_version_and_carries_it(tokenizer):
    engine = CharacterEngine(tokenizer, lambda request: "ls", version=0)
    with OpenAIGateway(engine, tokenizer, LIMITS, model_name=MODEL) as gateway:
        session = gateway.open_attempt("t", "g", 0, update=1, policy_version=1)  # θ_1 not yet acknowledged
        answers: list = []
        caller = threading.Thread(
            target=lambda: answers.append(
                _client(gateway, session.key).chat.completions.create(model=MODEL, messages=[SYSTEM, USER])
            )
        )
        caller.start()
        time.sleep(0.5)
        assert not answers and not engine.requests  # held, not failed, and nothing sampled at θ_0
        engine.version = 1  # every replica acknowledged θ_1
        caller.join(10)
        assert answers[0].system_fingerprint == "tslightning-policy-v1"
        assert [turn.policy_version for turn in session.trajectory.turns] == [1]

        stale = gateway.open_attempt("t", "g", 1, update=0, policy_version=0)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            _client(gateway, stale.key).chat.completions.create(model=MODEL, messages=[SYSTEM, USER])
        assert refused.value.code == "attempt_stale"


def test_a_rewritten_history_opens_a_segment_unless_the_gateway_takes_one(tokenizer):
    engine = CharacterEngine(tokenizer, lambda request: "ls")
    rewritten = [SYSTEM, {"role": "user", "content": "Summary: listed. Now count."}]
    for allow_segments in (False, True):
        with OpenAIGateway(engine, tokenizer, LIMITS, model_name=MODEL, allow_segments=allow_segments) as gateway:
            session = gateway.open_attempt("t", "g", 0, update=0)
            client = _client(gateway, session.key)
            client.chat.completions.create(model=MODEL, messages=[SYSTEM, USER])
            if not allow_segments:
                with pytest.raises(openai.PermissionDeniedError) as refused:
                    client.chat.completions.create(model=MODEL, messages=rewritten)
                assert refused.value.code == "history_rewritten" and session.end_reason == "history_rewritten"
                assert session.trajectory.segments == 1
                continue
            second = client.chat.completions.create(model=MODEL, messages=rewritten)
            trajectory = session.trajectory
            assert second.model_extra["tslightning"]["segment"] == 1 and trajectory.segment_starts == [0, 1]
            prompt = tokenizer.apply_chat_template(rewritten, add_generation_prompt=True, tokenize=True)["input_ids"]
            sampled = character_ids(tokenizer, "ls") + [tokenizer.eos_token_id]
            assert trajectory.token_ids(through_turn=1).tolist() == list(prompt) + sampled
            assert trajectory.scored_mask(only_turn=1).sum() == len(sampled)
            with pytest.raises(ValueError, match="2 segments"):
                trajectory.token_ids()  # as one sequence it exists only with one segment
            trajectory.reward = 0.5
            source = trajectory.trajectory_source()  # GRPO: a sequence per segment, scored under its own context
            assert source.segments[0][0].tolist() == list(prompt) + sampled and source.num_scored == 2 * len(sampled)


def test_a_port_in_use_is_refused_at_start_and_leaves_no_thread(served, tokenizer):
    gateway, engine = served
    port = int(gateway.url.rsplit(":", 1)[1])
    second = OpenAIGateway(engine, tokenizer, LIMITS, port=port)
    with pytest.raises(OSError):
        second.start()
    assert not second._thread.is_alive()


def test_a_speculating_engine_refuses_log_probs_before_sampling(tokenizer):
    from tslightning.rollout.speculative import SpeculativeSettings

    engine = CharacterEngine(tokenizer, lambda request: "ls")
    engine.speculative = SpeculativeSettings()
    with OpenAIGateway(engine, tokenizer, LIMITS, run_seed=7, model_name=MODEL) as gateway:
        client = _client(gateway, gateway.open_attempt("count", "g", 0, update=0).key)
        with pytest.raises(openai.BadRequestError, match="speculative decoding") as refused:
            client.chat.completions.create(model=MODEL, messages=[SYSTEM, USER], logprobs=True)
        assert refused.value.body["param"] == "logprobs" and engine.requests == []  # nothing was sampled
        reply = client.chat.completions.create(model=MODEL, messages=[SYSTEM, USER])
        assert reply.choices[0].message.content == "ls"
