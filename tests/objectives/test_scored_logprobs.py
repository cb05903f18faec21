"""Scored log-probs through the chunked head inside the tiny transformer's own forward, against the full-logits
computation (``model(ids).logits`` then a log-softmax): values and every parameter's gradient, single and padded
batches, tied embeddings, LoRA, bfloat16 autocast, and what a pass saves for its backward."""

from __future__ import annotations

import pytest
import torch

from tslightning.objectives.chunked_head import chunkable_head
from tslightning.objectives.scored_logprobs import batched_scored_logprobs, checked_chunk_tokens, scored_logprobs

FLOAT64_TOLERANCE = 1e-13
BF16_TOLERANCE = 2**-7
"""Only the tied embedding/head weight's gradient is summed over rows in the head: each chunk's part is rounded to
bfloat16 once before the float32 sum, where the full-logits path rounds the whole sum once (unit roundoff 2^-9)."""


def _sequence(vocab_size: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (length,), generator=g)
    mask = torch.rand(length, generator=g) < 0.4  # scattered scored positions
    mask[0], mask[-1] = False, True
    return ids, mask


def _full_logits(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids[None]).logits[0, :-1][mask[1:]]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[1:][mask[1:], None])[:, 0]


def _grads(model, logps: list[torch.Tensor]) -> list[torch.Tensor]:
    parameters = [p for p in model.parameters() if p.requires_grad]
    weights = torch.Generator().manual_seed(7)
    objective = sum((lp * torch.randn(lp.shape, generator=weights, dtype=torch.float64).to(lp)).sum() for lp in logps)
    return list(torch.autograd.grad(objective, parameters))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _assert_equal(logps, grads, expected_logps, expected_grads, tolerance=FLOAT64_TOLERANCE):
    for value, expected in zip(logps, expected_logps, strict=True):
        assert value.shape == expected.shape and float((value - expected).abs().max().detach()) <= tolerance
    assert len(grads) == len(expected_grads)
    for grad, expected in zip(grads, expected_grads, strict=True):
        assert _rel(grad, expected) <= tolerance


@pytest.mark.parametrize("chunk", [1, 7, "scored", 10_000])
def test_float64_equals_the_full_logits_with_tied_embeddings(make_policy, vocab_size, chunk):
    policy = make_policy()
    assert policy.lm_head.weight is policy.get_input_embeddings().weight  # both uses' gradients must add up
    ids, mask = _sequence(vocab_size, 41, seed=0)
    chunk = int(mask.sum()) if chunk == "scored" else chunk
    expected = [_full_logits(policy, ids, mask)]
    logps = [scored_logprobs(policy, ids, mask, chunk_tokens=chunk)]
    _assert_equal(logps, _grads(policy, logps), expected, _grads(policy, expected))


def test_the_padded_batch_scores_each_sequence_as_alone(make_policy, vocab_size):
    policy = make_policy()
    batch = [_sequence(vocab_size, length, seed) for seed, length in enumerate([37, 12, 29])]
    expected = [_full_logits(policy, ids, mask) for ids, mask in batch]
    logps = batched_scored_logprobs(policy, [ids for ids, _ in batch], [mask for _, mask in batch], chunk_tokens=5)
    _assert_equal(logps, _grads(policy, logps), expected, _grads(policy, expected), tolerance=1e-12)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["q_proj", "lm_head"]], ids=["decoder", "head"])
def test_lora_adapters_get_the_full_logits_gradient(make_policy, vocab_size, targets):
    """A LoRA-adapted head is not a plain linear layer: it is scored through its logits of the scored rows."""
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(
        make_policy(), LoraConfig(r=2, lora_alpha=4, target_modules=targets, init_lora_weights=False)
    )
    assert (chunkable_head(policy) is None) == ("lm_head" in targets)
    ids, mask = _sequence(vocab_size, 33, seed=3)
    expected = [_full_logits(policy, ids, mask)]
    logps = [scored_logprobs(policy, ids, mask, chunk_tokens=4)]
    _assert_equal(logps, _grads(policy, logps), expected, _grads(policy, expected))


def test_bf16_autocast_values_equal_and_gradients_within_bf16_rounding(make_policy, vocab_size):
    policy = make_policy(torch.float32)
    ids, mask = _sequence(vocab_size, 64, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = [_full_logits(policy, ids, mask)]
        expected_grads = _grads(policy, expected)
        logps = [scored_logprobs(policy, ids, mask, chunk_tokens=6)]
        grads = _grads(policy, logps)
    assert logps[0].dtype == torch.float32 and torch.equal(logps[0], expected[0])  # the same ops on every row
    named = [name for name, p in policy.named_parameters() if p.requires_grad]
    for name, grad, reference in zip(named, grads, expected_grads, strict=True):
        tied = name == "model.embed_tokens.weight"
        assert _rel(grad, reference) <= (BF16_TOLERANCE if tied else 1e-5), name


def test_a_model_that_transforms_its_logits_is_scored_through_them_or_refused(make_policy, vocab_size):
    policy = make_policy()
    ids, mask = _sequence(vocab_size, 20, seed=9)
    expected = _full_logits(policy, ids, mask)
    policy.config.final_logit_softcapping = 30.0  # a Gemma-style transform the config announces (Qwen2 ignores it)
    assert chunkable_head(policy) is None
    assert float((scored_logprobs(policy, ids, mask) - expected).abs().max().detach()) <= FLOAT64_TOLERANCE
    policy.config.final_logit_softcapping = None

    class Doubled(torch.nn.Module):  # a transform nothing announces
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def get_output_embeddings(self):
            return self.inner.get_output_embeddings()

        def forward(self, **inputs):
            output = self.inner(**inputs)
            output.logits = output.logits * 2
            return output

    with pytest.raises(RuntimeError, match="returned logits computed from its output head's result"):
        scored_logprobs(Doubled(policy), ids, mask)


def test_a_pass_saves_no_logits_beyond_one_chunk(make_policy, vocab_size):
    """Counted as ``tslightning plan`` counts (saved-tensor hooks, parameters by reference excluded): the full-logits
    pass saves T × V log-softmax; the chunked one nothing of V but the head's parameter, in forward and backward."""
    policy = make_policy()
    ids = torch.randint(0, vocab_size, (96,), generator=torch.Generator().manual_seed(0))
    mask = torch.arange(96) > 0
    parameters = {p.untyped_storage().data_ptr() for p in policy.parameters()}

    def saved_shapes(score) -> tuple[list[torch.Size], list[torch.Size]]:
        shapes: list[torch.Size] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() not in parameters:
                shapes.append(tensor.shape)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            logp = score()
            forward = list(shapes)
            torch.autograd.grad(logp.sum(), list(policy.parameters()))
        return forward, shapes

    forward, both = saved_shapes(lambda: scored_logprobs(policy, ids, mask, chunk_tokens=16))
    assert not [s for s in forward if vocab_size in s]  # nothing of the vocabulary is kept for the backward
    assert max(s.numel() for s in both if vocab_size in s) <= 16 * vocab_size  # the backward: one chunk at a time
    full, _ = saved_shapes(lambda: _full_logits(policy, ids, mask))
    assert torch.Size([95, vocab_size]) in full


def test_chunk_sizes_are_checked():
    assert checked_chunk_tokens(1) == 1
    for bad in (0, -3, True, 2.0):
        with pytest.raises(ValueError, match="logprob_chunk_tokens must be an int >= 1"):
            checked_chunk_tokens(bad)
