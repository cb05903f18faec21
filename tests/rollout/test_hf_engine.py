"""HFRolloutEngine on the tiny Qwen2: learner-exact ids and log-probs, seeding, stops, publication, replica death."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from engine_checks import (
    chat_prompts,
    check_alone_and_in_a_batch_sample_the_same,
    check_in_flight_requests_finish_under_the_old_version,
    check_restores,
    check_sampled_ids_and_logprobs,
    check_seeds_decide_the_tokens,
    check_served_by,
    check_stop_token_ends_the_turn,
    perturbed,
    report_generation_and_publication_time,
    saved_tiny_model,
)

from tslightning.rollout.engine import GenerationRequest, RolloutEngine, RolloutEngineError
from tslightning.rollout.hf.engine import HFRolloutEngine


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("rollout"))


@pytest.fixture(scope="module")
def engine(tiny):
    with HFRolloutEngine(tiny[0], replicas=2, publish_timeout=60) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(tiny):
    return chat_prompts(tiny[2])


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)


def test_sampled_ids_and_logprobs_are_what_the_learner_sees(engine, tiny, prompts):
    check_sampled_ids_and_logprobs(engine, tiny[1], prompts, timeout=60)


def test_seeds_decide_the_tokens(engine, prompts):
    check_seeds_decide_the_tokens(engine, prompts)


def test_request_samples_the_same_alone_and_in_a_batch(engine, prompts):
    check_alone_and_in_a_batch_sample_the_same(engine, prompts)


def test_stop_token_ends_the_turn(engine, prompts):
    check_stop_token_ends_the_turn(engine, prompts)


def test_invalid_requests_are_rejected_at_submit(engine, prompts):
    with pytest.raises(ValueError, match="max_tokens.*temperature"):
        engine.submit(GenerationRequest("bad", prompts[0], 0, seed=0, temperature=0.0))
    with pytest.raises(ValueError, match="prompt_token_ids must lie in"):
        engine.submit(GenerationRequest("bad", (10**6,), 4, seed=0))


def test_publication_serves_the_new_weights_then_restores(engine, tiny, prompts):
    model = tiny[1]
    request = GenerationRequest("pub", prompts[3], 16, seed=21)
    before = engine.generate([request], 60)[0]
    new_model = perturbed(model)
    version = engine.policy_version + 1

    receipt = engine.publish(new_model.state_dict(), version)

    assert (receipt.policy_version, receipt.replicas, engine.policy_version) == (version, 2, version)
    for after in engine.generate([request, request], 60):  # one per replica: both serve the new weights
        check_served_by(after, version, new_model, instead_of=model, prompt=request.prompt_token_ids)
    check_restores(engine, model, request, before)


def test_requests_in_flight_finish_under_the_old_version(engine, tiny, prompts):
    check_in_flight_requests_finish_under_the_old_version(engine, tiny[1], prompts)


def test_publish_rejects_bad_state_dicts_and_stale_versions(engine, tiny):
    state = tiny[1].state_dict()
    with pytest.raises(ValueError, match="must increase"):
        engine.publish(state, engine.policy_version)
    broken = {name: tensor for name, tensor in state.items() if "layers.0.mlp" not in name}
    broken["extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing: .*layers\.0\.mlp.*unknown: extra\.weight"):
        engine.publish(broken, engine.policy_version + 1)


def test_killed_replica_fails_pending_futures_and_publish(tiny, prompts):
    engine = HFRolloutEngine(tiny[0], publish_timeout=30)
    try:
        pending = engine.submit(GenerationRequest("long", prompts[0], 4000, seed=0))
        time.sleep(0.3)
        assert not pending.done()
        os.kill(engine._replicas[0].process.pid, signal.SIGKILL)

        error = pending.exception(timeout=30)
        assert isinstance(error, RolloutEngineError)
        assert "killed by SIGKILL" in str(error)
        start = time.monotonic()
        with pytest.raises(RolloutEngineError, match="replica 0"):
            engine.publish(tiny[1].state_dict(), 1)
        assert time.monotonic() - start < 10
        with pytest.raises(RolloutEngineError):
            engine.submit(GenerationRequest("late", prompts[0], 4, seed=0))
    finally:
        engine.close()
    assert not engine._replicas[0].process.is_alive()


def test_report_generation_and_publication_time(engine, tiny, prompts, capsys):
    """Timing report (printed, never asserted): 8 requests x 32 tokens, and one publication."""
    report_generation_and_publication_time(
        engine, tiny[1], prompts, 60, "HFRolloutEngine, 2 replicas x 1 thread", capsys
    )


def test_a_publication_drops_kept_prefixes(tiny, prompts):
    """A second turn after new weights must not reuse K/V computed under the old ones: its log-probs are the new
    policy's on the whole context (and a second turn before the publication reuses and still matches)."""
    from engine_checks import ATOL, rescore

    path, model, _ = tiny
    new_model = perturbed(model)
    with HFRolloutEngine(path, replicas=1, publish_timeout=60) as single:
        (turn1,) = single.generate([GenerationRequest("t1", prompts[2], 8, seed=1)], 60)
        context = (*prompts[2], *turn1.token_ids, *prompts[0][-4:])
        (same_weights,) = single.generate([GenerationRequest("t2", context, 8, seed=2)], 60)
        expected = rescore(model, context, same_weights.token_ids)
        torch.testing.assert_close(torch.tensor(same_weights.logprobs), expected, atol=ATOL, rtol=0)
        single.publish(new_model.state_dict(), policy_version=1)
        longer = (*context, *same_weights.token_ids, *prompts[0][-4:])
        (after,) = single.generate([GenerationRequest("t3", longer, 8, seed=3)], 60)
        expected = rescore(new_model, longer, after.token_ids)
        torch.testing.assert_close(torch.tensor(after.logprobs), expected, atol=ATOL, rtol=0)
        assert after.policy_version == 1


def test_prefix_cache_size_is_checked(tiny):
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        HFRolloutEngine(tiny[0], prefix_cache_tokens=-1)
