"""Prefix K/V reuse in the hf replica: the same samples and log-probs as a full prefill, less prefill work."""

from __future__ import annotations

import pytest
import torch
from engine_checks import chat_prompts, rescore, saved_tiny_model

from tslightning.rollout.engine import GenerationRequest
from tslightning.rollout.hf.prefix_cache import PrefixKVCache
from tslightning.rollout.hf.replica import _sample_batch, supports_prefix_cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, model, tokenizer = saved_tiny_model(tmp_path_factory.mktemp("prefix"))
    return model.double().eval(), tokenizer


def _kv(tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, tokens, 2), torch.zeros(1, tokens, 2))]


def test_take_returns_the_longest_proper_prefix_and_removes_it():
    cache = PrefixKVCache(max_tokens=100)
    cache.store((1, 2), _kv(2))
    cache.store((1, 2, 3, 4), _kv(4))
    cache.store((9, 9, 9), _kv(3))
    n, layers = cache.take((1, 2, 3, 4, 5))
    assert n == 4 and layers[0][0].shape[1] == 4 and len(cache) == 2  # the extended entry is gone
    n, layers = cache.take((1, 2, 3, 4, 5))
    assert n == 2 and layers[0][0].shape[1] == 2
    assert cache.hits == 2 and cache.reused_tokens == 6
    assert cache.take((7, 7)) == (0, None)


def test_a_prompt_equal_to_an_entry_is_not_a_hit():
    """At least one prompt token must be prefilled: its logits give the first sampled token."""
    cache = PrefixKVCache(max_tokens=100)
    cache.store((1, 2, 3), _kv(3))
    assert cache.take((1, 2, 3)) == (0, None) and len(cache) == 1


def test_budget_evicts_the_oldest_entries():
    cache = PrefixKVCache(max_tokens=6)
    cache.store((1, 2, 3), _kv(3))
    cache.store((4, 5, 6), _kv(3))
    cache.store((7, 8), _kv(2))
    assert len(cache) == 2 and cache.tokens == 5
    assert cache.take((1, 2, 3, 0)) == (0, None)
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_tokens"):
        PrefixKVCache(max_tokens=0)
    with pytest.raises(ValueError, match="positions"):
        PrefixKVCache(max_tokens=10).store((1, 2, 3), _kv(2))


def _request(name: str, prompt, seed: int, max_tokens: int = 12) -> GenerationRequest:
    return GenerationRequest(name, tuple(prompt), max_tokens, seed, 1.0, (10**9,))


def test_second_turns_sample_the_same_with_and_without_reuse(tiny):
    """Float64: turn 2 from kept K/V (rows of different cached lengths, one row with nothing kept, all in one padded
    batch) samples the same tokens with log-probs equal to a full prefill within 1e-10."""
    model, tokenizer = tiny
    assert supports_prefix_cache(model)
    prompts = chat_prompts(tokenizer)
    cache = PrefixKVCache(max_tokens=10_000)
    first = _sample_batch(model, [_request(f"a{i}", p, seed=i) for i, p in enumerate(prompts[:3])], 0, cache)
    assert len(cache) == 3
    observation = tuple(tokenizer("gauge reading 1: 0123456789")["input_ids"])
    second = [
        _request(f"b{i}", (*prompts[i], *g.token_ids, *observation[: 3 + 4 * i]), seed=10 + i)
        for i, g in enumerate(first)
    ] + [_request("fresh", prompts[3], seed=20)]
    reused = _sample_batch(model, second, 0, cache)
    full = _sample_batch(model, second, 0, None)
    kept = sum(len(p) + len(g.token_ids) - 1 for p, g in zip(prompts[:3], first, strict=True))
    assert cache.hits == 3 and cache.reused_tokens == kept
    for a, b in zip(reused, full, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= 1e-10
    assert len(cache) == 4  # every second-turn sequence kept for a third turn


def test_rollout_samples_match_the_learner_after_reuse(tiny):
    """The log-probs of a reused-prefix turn are what one full forward over the whole context gives."""
    model, tokenizer = tiny
    prompt = chat_prompts(tokenizer)[1]
    cache = PrefixKVCache(max_tokens=10_000)
    (turn1,) = _sample_batch(model, [_request("a", prompt, seed=3)], 0, cache)
    context = (*prompt, *turn1.token_ids, *tokenizer("[exit code 0]")["input_ids"])
    (turn2,) = _sample_batch(model, [_request("b", context, seed=4)], 0, cache)
    assert cache.hits == 1
    expected = rescore(model, context, list(turn2.token_ids)).double()
    assert torch.allclose(torch.tensor(turn2.logprobs, dtype=torch.float64), expected, atol=1e-10, rtol=0)
