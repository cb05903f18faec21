"""What the rollout-engine tests (test_hf_engine.py, test_vllm_engine.py) share on the tiny Qwen2: the saved model and
its chat prompts, the learner's re-scoring, and the checks every RolloutEngine passes the same way.

Imported as ``from engine_checks import ...``: there is no ``__init__.py`` here, so pytest puts this directory on
sys.path.
"""

from __future__ import annotations

import copy
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from tslightning.models.tiny_model import CORPUS, load_tiny_model, save_tiny_model
from tslightning.rollout.engine import Generation, GenerationRequest, RolloutEngine

ATOL = 2e-5  # float32: the engine's batched, cached decode vs one full forward in the learner


def saved_tiny_model(directory: Path):
    """The tiny Qwen2 saved under ``directory`` and loaded back: ``(path, model, tokenizer)``."""
    path = save_tiny_model(directory / "tiny")
    model, tokenizer = load_tiny_model(path)
    return path, model, tokenizer


def chat_prompts(tokenizer) -> list[tuple[int, ...]]:
    """Four user turns, short to long, as chat-templated prompt ids ready for the assistant's answer."""
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


def check_sampled_ids_and_logprobs(engine: RolloutEngine, model, prompts, timeout: float) -> None:
    """Every generation runs to ``max_tokens`` at the engine's version, with the log-probs the learner computes."""
    temperatures = [1.0, 1.0, 0.7, 1.0]
    requests = [
        GenerationRequest(f"r{i}", p, 12, seed=i, temperature=t)
        for i, (p, t) in enumerate(zip(prompts, temperatures, strict=True))
    ]
    for request, generation in zip(requests, engine.generate(requests, timeout=timeout), strict=True):
        assert generation.request_id == request.request_id
        assert len(generation.token_ids) == len(generation.logprobs) == 12
        assert generation.finish_reason == "length"
        assert generation.policy_version == engine.policy_version
        expected = rescore(model, request.prompt_token_ids, generation.token_ids, request.temperature)
        torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=ATOL, rtol=0)


def check_seeds_decide_the_tokens(engine: RolloutEngine, prompts) -> None:
    same, again, other = engine.generate([GenerationRequest(str(s), prompts[0], 16, seed=s) for s in (7, 7, 8)], 60)
    assert same.token_ids == again.token_ids
    assert same.token_ids != other.token_ids


def check_alone_and_in_a_batch_sample_the_same(engine: RolloutEngine, prompts) -> None:
    request = GenerationRequest("me", prompts[1], 20, seed=11)
    alone = engine.submit(request).result(60)
    others = [GenerationRequest(f"o{i}", p, 5 + 7 * i, seed=100 + i) for i, p in enumerate(prompts)]
    batched = engine.generate([*others[:2], request, *others[2:]], timeout=60)[2]
    assert batched.token_ids == alone.token_ids
    torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=ATOL, rtol=0)


def check_prompts_over_one_steps_budget_sample_as_alone(
    engine: RolloutEngine, count: int, prompt_tokens: int, vocab: int = 200
) -> None:
    """``count`` seeded requests of ``prompt_tokens``-token prompts submitted together, more prompt tokens than the
    engine prefills in one step: every one comes back, with the tokens and log-probs it samples alone. (vLLM 0.32
    on CPU used to split such prompts over steps and then crash rewinding the seeded generator: "CPU Generator does
    not use offset".)"""
    prompts = [tuple(random.Random(i).randrange(3, vocab) for _ in range(prompt_tokens)) for i in range(count)]
    requests = [GenerationRequest(f"long{i}", prompt, 4, seed=40 + i) for i, prompt in enumerate(prompts)]
    together = engine.generate(requests, timeout=300)
    for request, batched in zip(requests, together, strict=True):
        alone = engine.generate([request], timeout=120)[0]
        assert batched.token_ids == alone.token_ids, request.request_id
        torch.testing.assert_close(torch.tensor(batched.logprobs), torch.tensor(alone.logprobs), atol=ATOL, rtol=0)


def check_stop_token_ends_the_turn(engine: RolloutEngine, prompts) -> None:
    free = engine.generate([GenerationRequest("free", prompts[2], 16, seed=5)], 60)[0]
    stop = free.token_ids[6]
    end = free.token_ids.index(stop)
    stopped = engine.generate([GenerationRequest("stop", prompts[2], 16, seed=5, stop_token_ids=(stop,))], 60)[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: end + 1]
    assert stopped.logprobs == pytest.approx(free.logprobs[: end + 1], abs=ATOL)


def check_each_request_is_ready_when_done(engine: RolloutEngine, prompts, long_tokens: int = 400) -> None:
    """Submitted together, short requests are answered while a long one still decodes: readiness is per request,
    not per batch (ordering only, no speed).

    ``long_tokens`` sets the margin: the long request decodes that many tokens after the 2-token one is done, so a
    scheduling hiccup of the test process or the server (a loaded CI machine) shorter than that cannot reorder them.
    A first round with a short "long" request warms the engine's batch shapes (3, 2, 1 sequences) beforehand.
    """
    _answer_order(engine, prompts, [20, 2, 10], prefix="warm")
    lengths = [long_tokens, 2, 100]
    order, seconds = _answer_order(engine, prompts, lengths, prefix="len")
    assert order == [f"len{n}" for n in sorted(lengths)], (
        f"answers came back as {order} after {seconds} s: the 2-token turn waited for the {long_tokens}-token one "
        "(a batch-sized wave)"
    )


def _answer_order(engine: RolloutEngine, prompts, lengths: list[int], prefix: str) -> tuple[list[str], list[float]]:
    """Requests of ``lengths`` tokens submitted together: their ids in the order their futures completed, and the
    seconds from submission to each completion (in that order)."""
    done: list[tuple[str, float]] = []
    recorded = threading.Condition()

    def record(future):
        with recorded:
            done.append((future.result().request_id, round(time.perf_counter() - start, 3)))
            recorded.notify_all()

    start = time.perf_counter()
    futures = [engine.submit(GenerationRequest(f"{prefix}{n}", prompts[0], n, seed=n)) for n in lengths]
    for future in futures:
        future.add_done_callback(record)
    for future in futures:
        future.result(120)
    # A future's waiters wake before its done-callbacks run: wait for the last callback, not for the result.
    with recorded:
        assert recorded.wait_for(lambda: len(done) == len(lengths), timeout=30), f"callbacks ran for {done} only"
    return [request_id for request_id, _ in done], [at for _, at in done]


def check_served_by(generation: Generation, version: int, served, instead_of, prompt) -> None:
    """``generation`` came from ``served`` published at ``version``: its log-probs, not ``instead_of``'s."""
    assert generation.policy_version == version
    expected = rescore(served, prompt, generation.token_ids)
    torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=ATOL, rtol=0)
    old = rescore(instead_of, prompt, generation.token_ids)
    assert (torch.tensor(generation.logprobs) - old).abs().max() > 1e-2


def check_restores(engine: RolloutEngine, model, request: GenerationRequest, before: Generation) -> None:
    """Publishing ``model`` again (at the next version) samples what it sampled ``before``."""
    version = engine.policy_version + 1
    engine.publish(model.state_dict(), version)
    restored = engine.generate([request], 60)[0]
    assert restored.policy_version == version
    assert restored.token_ids == before.token_ids
    assert restored.logprobs == pytest.approx(before.logprobs, abs=ATOL)


def check_in_flight_requests_finish_under_the_old_version(engine: RolloutEngine, model, prompts) -> None:
    old = engine.policy_version
    in_flight = engine.submit(GenerationRequest("long", prompts[0], 300, seed=3))

    engine.publish(perturbed(model).state_dict(), old + 1)

    assert in_flight.done(), "publish must wait for the batch already running"
    generation = in_flight.result()
    assert generation.policy_version == old
    expected = rescore(model, prompts[0], generation.token_ids)
    torch.testing.assert_close(torch.tensor(generation.logprobs), expected, atol=ATOL, rtol=0)
    engine.publish(model.state_dict(), old + 2)


def report_generation_and_publication_time(
    engine: RolloutEngine, model, prompts, timeout: float, label: str, capsys
) -> None:
    """Timing report (printed, never asserted): 8 requests x 32 tokens, and one publication of ``model``."""
    requests = [GenerationRequest(f"t{i}", prompts[i % 4], 32, seed=i) for i in range(8)]
    engine.generate(requests, timeout)  # warm-up
    start = time.perf_counter()
    engine.generate(requests, timeout)
    generate_s = time.perf_counter() - start
    receipt = engine.publish(model.state_dict(), engine.policy_version + 1)
    with capsys.disabled():
        print(f"\n[{label}] generate 8x32 tokens: {generate_s:.3f} s; publish: {receipt.seconds * 1e3:.1f} ms")
