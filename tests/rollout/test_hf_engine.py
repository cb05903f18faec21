"""HFRolloutEngine on the tiny Qwen2: learner-exact ids and log-probs, seeding, stops, publication, replica death."""

from __future__ import annotations

import copy
import os
import signal
import time

import pytest
import torch

from tslightning.rollout.engine import GenerationRequest, RolloutEngine, RolloutEngineError
from tslightning.rollout.hf_engine import HFRolloutEngine
from tslightning.tiny_model import CORPUS, load_tiny_model, save_tiny_model

ATOL = 2e-5  # float32: the engine's cached, batched decode vs one full forward in the learner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = save_tiny_model(tmp_path_factory.mktemp("rollout") / "tiny")
    model, tokenizer = load_tiny_model(path)
    return path, model, tokenizer


@pytest.fixture(scope="module")
def engine(tiny):
    with HFRolloutEngine(tiny[0], replicas=2, publish_timeout=60) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(tiny):
    tokenizer = tiny[2]
    texts = ["Hi there.", "What is the capital of France?", "Count the lines in file.txt.", " ".join(CORPUS[200:210])]
    conversations = [[{"role": "user", "content": text}] for text in texts]
    return [tuple(tokenizer.apply_chat_template(c, add_generation_prompt=True)["input_ids"]) for c in conversations]


def rescore(model, prompt, token_ids, temperature=1.0):
    """What the learner computes: log_softmax of one full forward over prompt + sampled ids, at the sampled ids."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(token_ids)])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def perturbed(model, scale=0.05):
    copied = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
    return copied


def test_engine_satisfies_protocol(engine):
    assert isinstance(engine, RolloutEngine)


def test_sampled_ids_and_logprobs_are_what_the_learner_sees(engine, tiny, prompts):
    model = tiny[1]
    temperatures = [1.0, 1.0, 0.7, 1.0]
    requests = [
        GenerationRequest(f"r{i}", p, 12, seed=i, temperature=t)
        for i, (p, t) in enumerate(zip(prompts, temperatures, strict=True))
    ]
    for request, generation in zip(requests, engine.generate(requests, timeout=60), strict=True):
        assert generation.request_id == request.request_id
        assert len(generation.token_ids) == len(generation.logprobs) == 12
        assert generation.finish_reason == "length"
        assert generation.policy_version == engine.policy_version
        expected = rescore(model, request.prompt_token_ids, generation.token_ids, request.temperature)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=ATOL, rtol=0)


def test_seeds_decide_the_tokens(engine, prompts):
    same, again, other = engine.generate([GenerationRequest(str(s), prompts[0], 16, seed=s) for s in (7, 7, 8)], 60)
    assert same.token_ids == again.token_ids
    assert same.token_ids != other.token_ids


def test_request_samples_the_same_alone_and_in_a_batch(engine, prompts):
    request = GenerationRequest("me", prompts[1], 20, seed=11)
    alone = engine.submit(request).result(60)
    others = [GenerationRequest(f"o{i}", p, 5 + 7 * i, seed=100 + i) for i, p in enumerate(prompts)]
    batched = engine.generate([*others[:2], request, *others[2:]], timeout=60)[2]
    assert batched.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=ATOL, rtol=0)


def test_stop_token_ends_the_turn(engine, prompts):
    free = engine.generate([GenerationRequest("free", prompts[2], 16, seed=5)], 60)[0]
    stop = free.token_ids[6]
    end = free.token_ids.index(stop)
    stopped = engine.generate([GenerationRequest("stop", prompts[2], 16, seed=5, stop_token_ids=(stop,))], 60)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: end + 1]
    assert stopped.logprobs == pytest.approx(free.logprobs[: end + 1], abs=ATOL)


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
        assert after.policy_version == version
        expected = rescore(new_model, request.prompt_token_ids, after.token_ids)
        torch.testing.assert_close(torch.tensor(after.logprobs), expected, atol=ATOL, rtol=0)
        old = rescore(model, request.prompt_token_ids, after.token_ids)
        assert (torch.tensor(after.logprobs) - old).abs().max() > 1e-2

    engine.publish(model.state_dict(), version + 1)
    restored = engine.generate([request], 60)[0]
    assert restored.policy_version == version + 1
    assert restored.token_ids == before.token_ids
    assert restored.logprobs == pytest.approx(before.logprobs, abs=ATOL)


def test_requests_in_flight_finish_under_the_old_version(engine, tiny, prompts):
    model = tiny[1]
    old = engine.policy_version
    in_flight = engine.submit(GenerationRequest("long", prompts[0], 300, seed=3))

    engine.publish(perturbed(model).state_dict(), old + 1)

    assert in_flight.done(), "publish must wait for the batch already running"
    generation = in_flight.result()
    assert generation.policy_version == old
    expected = rescore(model, prompts[0], generation.token_ids)
    torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=ATOL, rtol=0)
    engine.publish(model.state_dict(), old + 2)


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
    requests = [GenerationRequest(f"t{i}", prompts[i % 4], 32, seed=i) for i in range(8)]
    engine.generate(requests, 60)  # warm-up
    start = time.perf_counter()
    engine.generate(requests, 60)
    generate_s = time.perf_counter() - start
    receipt = engine.publish(tiny[1].state_dict(), engine.policy_version + 1)
    with capsys.disabled():
        print(
            f"\n[HFRolloutEngine, 2 replicas x 1 thread] generate 8x32 tokens: {generate_s:.3f} s; "
            f"publish: {receipt.seconds * 1e3:.1f} ms"
        )
