"""Speculative decoding changes nothing but time: on fixed prompts at the run's temperature, the tokens vLLM samples
with a model-free drafter (``rollout.speculative``, ngram) are distributed as those it samples without — χ² tests
of the first tokens, the whole answer's rate, and the mean length — and the same test catches a sampler that is off
(here: the draft positions sampled at a wrong temperature, as vLLM 0.32's CPU fallback does).

The policy is the tiny model fitted for a few seconds to quote a note from its prompt at temperature 1, so the
drafts (the note, found in the prompt) are often accepted and often rejected: both branches of the rejection sampler
are exercised. Samples per arm: 4,000, enough to detect a 5-point change of any token's frequency (two-sided
α = 0.001, power 80%; :func:`sampling_statistics.detectable_shift`). Threshold: p < 0.001 rejects "one distribution",
Bonferroni-corrected over the positions tested.
"""

from __future__ import annotations

import contextlib
import math
import statistics

import pytest
import torch
from sampling_statistics import detectable_shift, goodness_of_fit_p_value, homogeneity_p_value

from tslightning.models.tiny_model import TinyModelConfig, build_tiny_model, build_tokenizer
from tslightning.rollout.engine import GenerationRequest
from tslightning.rollout.speculative import SpeculativeSettings

SAMPLES = 4000
POSITIONS = 4
"""The first tokens compared position by position (drafts are verified from the first one on)."""
ALPHA = 1e-3
FIT_STEPS = 80
"""AdamW steps fitting the note: a policy that quotes it about half of the time (drafts accepted 60-90%)."""
NOTE = "calibrate the gauge before each reading and log the value"
STOP = build_tokenizer().eos_token_id
"""``<|im_end|>``: the end of an assistant turn."""
ALWAYS = SpeculativeSettings(num_speculative_tokens=4, prompt_lookup_min=2, max_running_sequences=None)
"""Speculating at every batch size: the test samples thousands of sequences at once."""


@pytest.fixture(scope="module")
def note_policy(tmp_path_factory):
    """The tiny model fitted (``FIT_STEPS`` AdamW steps) to answer its prompt with ``<bash>log "NOTE"</bash>``; its
    prompt ends with ``log "``, which also occurs earlier in it, followed by the note: the drafter proposes the note."""
    pytest.importorskip("vllm")
    tokenizer = build_tokenizer()
    model = build_tiny_model(TinyModelConfig(seed=0), tokenizer).train()
    prompt = tokenizer.encode(f'<|im_start|>user\nRun: log "{NOTE}"<|im_end|>\n<|im_start|>assistant\n<bash>log "')
    answer = tokenizer.encode(f'{NOTE}"</bash><|im_end|>')
    ids, labels = torch.tensor([prompt + answer]), torch.tensor([[-100] * len(prompt) + answer])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(0)
    for _ in range(FIT_STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    path = tmp_path_factory.mktemp("note-policy")
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    with torch.no_grad():
        first = torch.softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].double(), dim=-1)
    return path, prompt, answer, first


@pytest.fixture(scope="module")
def samples(note_policy):
    """Every sample the tests compare, ``SAMPLES`` seeds each: with speculation off, then on (two engines, in this
    order: vLLM 0.32 cannot register its CPU kernels in a process where the ngram drafter's numba code is loaded),
    and with the draft positions sampled at temperature 1 whatever the request's."""
    from tslightning.rollout.vllm_engine.engine import VLLMRolloutEngine

    path, prompt, answer, _ = note_policy
    runs = {"short": (POSITIONS, 1.0), "whole": (len(answer) + 8, 1.0), "cold": (POSITIONS, 0.7)}
    sampled = {}
    for arm, speculative in (("off", None), ("on", ALWAYS)):
        with VLLMRolloutEngine(path, max_model_len=512, max_num_seqs=256, speculative=speculative) as engine:
            for run, (max_tokens, temperature) in runs.items():
                sampled[arm, run] = _generate(engine, prompt, max_tokens, temperature)
            if speculative is not None:
                with _wrong_temperature():
                    sampled["broken", "cold"] = _generate(engine, prompt, POSITIONS, 0.7)
    return sampled


def _generate(engine, prompt, max_tokens: int, temperature: float):
    requests = [
        GenerationRequest(f"r{seed}", tuple(prompt), max_tokens, seed, temperature, stop_token_ids=(STOP,))
        for seed in range(SAMPLES)
    ]
    return engine.generate(requests, timeout=600)


@contextlib.contextmanager
def _wrong_temperature():
    """The rejection sampler's expand (vLLM's registered override) writing 1.0 for every request's temperature."""
    from vllm.v1.sample import rejection_sampler

    from tslightning.rollout.vllm_engine.cpu_sampling import expand_exactly

    def temperature_one(output, values, cumulative, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        expand_exactly(output, torch.ones_like(values), cumulative, replace_from, replace_to)

    override = rejection_sampler.expand_kernel  # a KernelOverride on the CPU platform
    exact = override._impl
    override._impl = override.func = temperature_one
    try:
        yield
    finally:
        override._impl = override.func = exact


def _differ(off, on) -> float:
    """The smallest p-value of the per-position χ² homogeneity tests (token t of every answer that has one),
    Bonferroni-corrected."""
    p_values = [
        homogeneity_p_value(*([g.token_ids[t] for g in arm if len(g.token_ids) > t] for arm in (off, on)))
        for t in range(POSITIONS)
    ]
    return min(1.0, POSITIONS * min(p_values))


def test_the_sample_size_detects_a_five_point_shift():
    assert detectable_shift(SAMPLES) <= 0.05


def test_speculation_samples_the_same_tokens_distribution(note_policy, samples):
    first = note_policy[3]
    off, on = samples["off", "short"], samples["on", "short"]
    assert all(g.speculation is not None and g.logprobs is None for g in on)
    drafted = sum(g.speculation.drafted for g in on)
    accepted = sum(g.speculation.accepted for g in on)
    assert drafted > SAMPLES and 0.2 < accepted / drafted < 0.98  # both accept and reject paths ran, often
    assert _differ(off, on) > ALPHA
    assert goodness_of_fit_p_value([g.token_ids[0] for g in on], first) > ALPHA  # the policy's own distribution


def test_whole_answers_keep_their_rate_and_length(note_policy, samples):
    answer = note_policy[2]
    off, on = samples["off", "whole"], samples["on", "whole"]
    solved = [sum(list(g.token_ids) == answer for g in arm) for arm in (off, on)]
    pooled = sum(solved) / (2 * SAMPLES)
    z_solved = (solved[0] - solved[1]) / SAMPLES / math.sqrt(2 * pooled * (1 - pooled) / SAMPLES)
    assert 0.05 < pooled < 0.95 and abs(z_solved) < 3.29  # two-sided α = 0.001
    lengths = [[len(g.token_ids) for g in arm] for arm in (off, on)]
    error = math.sqrt(sum(statistics.variance(arm) / SAMPLES for arm in lengths))
    assert abs(statistics.mean(lengths[0]) - statistics.mean(lengths[1])) < 3.29 * error


def test_the_same_test_passes_at_another_temperature_and_catches_a_sampler_at_the_wrong_one(samples):
    assert _differ(samples["off", "cold"], samples["on", "cold"]) > ALPHA
    assert _differ(samples["off", "cold"], samples["broken", "cold"]) < ALPHA
