"""The CPU rejection sampler's repair (:mod:`tslightning.rollout.vllm_engine.cpu_sampling`): the expand it installs
has the Triton kernel's semantics, vLLM's rejection sampler draws from the target distribution with it (χ² at the draft
positions, temperature 0.7), and the same test catches a sampler that scales the draft positions by a wrong
temperature — vLLM 0.32's CPU fallback does, with uninitialized memory."""

from __future__ import annotations

import pytest
import torch
from sampling_statistics import goodness_of_fit_p_value

from tslightning.rollout.vllm_engine.cpu_sampling import EXPAND_KERNEL, expand_exactly, expand_is_exact, install

P_THRESHOLD = 1e-3
"""Reject "drawn from the target distribution" below this p-value (each test's samples: 4,000 draws)."""


def _reference_expand(values, cumulative, replace_from, replace_to):
    out, start = [], 0
    for value, end in zip(values, cumulative, strict=True):
        out += [replace_to if value == replace_from else value] * (end - start)
        start = end
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_writes_each_request_value_to_its_positions(dtype):
    values = torch.tensor([3, 0, 5, 7], dtype=dtype)
    cumulative = torch.tensor([2, 2, 5, 6], dtype=torch.int32)  # the second request has no draft tokens
    output = torch.full((8,), -1, dtype=dtype)
    expand_exactly(output, values, cumulative, 0, 1)
    assert output[:6].tolist() == _reference_expand(values.tolist(), cumulative.tolist(), 0, 1)
    assert output[6:].tolist() == [-1, -1]  # past the drafts: untouched, like the kernel's masked store


def test_a_fallback_that_writes_into_a_copy_is_not_exact():
    def writes_a_copy(output, values, cumulative, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        expand_exactly(output.to(torch.int64), values.to(torch.int64), cumulative, replace_from, replace_to)

    assert not expand_is_exact(writes_a_copy)
    assert expand_is_exact(expand_exactly)


@pytest.fixture(scope="module")
def sampler():
    """vLLM's rejection sampler with the CPU platform's kernel fallbacks registered, then this plugin installed."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the fallbacks are the CPU platform's")
    current_platform.register_triton_kernel_overrides()
    install()
    from vllm.v1.sample import rejection_sampler

    yield rejection_sampler
    install()  # whatever a test registered, leave the exact expand behind


def _metadata(seed: int, temperature: float):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.tensor([temperature]),
        all_greedy=False,
        all_random=True,
        top_p=None,
        top_k=None,
        generators={0: torch.Generator().manual_seed(seed)},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(1),
        presence_penalties=torch.zeros(1),
        repetition_penalties=torch.ones(1),
        output_token_ids=[[]],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


LOGITS = torch.tensor(
    [
        [0.0, 2.5, 0.3, 1.0, -1.0, 0.0, 0.5, -0.5],
        [0.2, 0.0, 2.0, 0.4, 0.0, -1.0, 0.0, 0.3],
        [0.0, 0.1, 0.0, 1.5, 0.2, 0.0, -0.3, 0.0],
    ]
)
"""Target logits at three draft positions; the drafts are each position's mode, accepted about half the time."""


def _first_tokens(rejection_sampler, temperature: float, draws: int) -> list[int]:
    """The first output token of ``draws`` seeded verifications, as ``RejectionSampler.forward`` runs them: the
    request's temperature expanded to the draft positions and applied, then rejection sampling."""
    drafts, cumulative = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    firsts = []
    for seed in range(draws):
        metadata = _metadata(seed, temperature)
        target = rejection_sampler.apply_sampling_constraints(LOGITS.clone(), cumulative, metadata)
        out = rejection_sampler.rejection_sample(
            drafts, [3], 3, cumulative, None, target, torch.tensor([[7]]), metadata
        )
        firsts.append(int(out[0, 0]))
    return firsts


def test_vllms_own_cpu_fallback_writes_into_a_copy(sampler):
    from tslightning.rollout.vllm_engine import cpu_sampling as vllm_cpu_sampling

    fallback = vllm_cpu_sampling.replaced_fallback
    assert fallback is not None, "vLLM's CPU expand fallback is exact in this vLLM: the plugin is a no-op, drop it"
    assert not expand_is_exact(fallback)


def test_the_installed_expand_is_what_the_sampler_calls(sampler):
    from vllm.triton_utils import dispatcher

    assert expand_is_exact(dispatcher._registry[EXPAND_KERNEL][1])


def test_draft_positions_sample_the_target_distribution(sampler):
    temperature = 0.7
    firsts = _first_tokens(sampler, temperature, 4000)
    target = torch.softmax(LOGITS[0] / temperature, dim=-1)
    assert goodness_of_fit_p_value(firsts, target) > P_THRESHOLD


def test_the_same_test_catches_a_wrong_temperature(sampler):
    from vllm.triton_utils import dispatcher

    def temperature_one(output, values, cumulative, replace_from, replace_to, MAX_NUM_TOKENS=None):  # noqa: N803
        expand_exactly(output, torch.ones_like(values), cumulative, replace_from, replace_to)

    dispatcher.register_kernels({EXPAND_KERNEL: temperature_one})
    try:
        firsts = _first_tokens(sampler, 0.7, 4000)
    finally:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_exactly})
    assert goodness_of_fit_p_value(firsts, torch.softmax(LOGITS[0] / 0.7, dim=-1)) < P_THRESHOLD
