"""The chunked output head against the full-logits computation it replaces: values and gradients of the hidden rows,
the weight and the bias, in float64 and under bfloat16 autocast, and what it saves for the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tslightning.objectives.chunked_head import head_logprobs

ROWS, HIDDEN, VOCAB = 13, 8, 29
FLOAT64_TOLERANCE = 1e-13
BF16_TOLERANCE = 2**-7
"""A chunk's weight gradient is rounded to bfloat16 (unit roundoff 2^-9) once before the float32 sum over chunks,
where the full-logits path rounds the whole sum once: each differs from the exact sum by at most about one
rounding, so they agree to a couple of roundings of the largest entries, well inside 2^-7 in norm."""


def _inputs(dtype: torch.dtype, bias: bool = True, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, HIDDEN, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(VOCAB, generator=g, dtype=dtype, requires_grad=True) if bias else None
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    coefficients = torch.randn(ROWS, generator=g, dtype=torch.float64)
    return hidden, weight, b, targets, coefficients


def _full(hidden, weight, bias, targets):
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def _value_and_grads(score, hidden, weight, bias, targets, coefficients):
    logp = score(hidden, weight, bias, targets)
    leaves = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    return logp, torch.autograd.grad((logp * coefficients.to(logp)).sum(), leaves)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("chunk", [1, 4, ROWS, ROWS + 5])
@pytest.mark.parametrize("bias", [True, False])
def test_float64_values_and_gradients_equal_the_full_logits(chunk, bias):
    inputs = _inputs(torch.float64, bias)
    expected, expected_grads = _value_and_grads(_full, *inputs)
    chunked = lambda h, w, b, t: head_logprobs(h, t, w, b, chunk_rows=chunk)  # noqa: E731
    value, grads = _value_and_grads(chunked, *inputs)
    assert value.dtype == torch.float64 and float((value - expected).abs().max().detach()) <= FLOAT64_TOLERANCE
    assert len(grads) == len(expected_grads)
    for grad, reference in zip(grads, expected_grads, strict=True):
        assert _rel(grad, reference) <= FLOAT64_TOLERANCE


def test_a_frozen_head_passes_gradient_to_the_hidden_rows_only():
    hidden, weight, _, targets, coefficients = _inputs(torch.float64, bias=False)
    weight.requires_grad_(False)
    logp = head_logprobs(hidden, targets, weight, chunk_rows=5)
    (grad,) = torch.autograd.grad((logp * coefficients).sum(), [hidden])
    (expected,) = torch.autograd.grad((_full(hidden, weight, None, targets) * coefficients).sum(), [hidden])
    assert _rel(grad, expected) <= FLOAT64_TOLERANCE and weight.grad is None


def test_under_bfloat16_autocast_values_are_the_full_logits_and_gradients_within_bf16_rounding():
    hidden, weight, bias, targets, coefficients = _inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, expected_grads = _value_and_grads(_full, hidden, weight, bias, targets, coefficients)
        whole = lambda h, w, b, t: head_logprobs(h, t, w, b, chunk_rows=ROWS)  # noqa: E731
        value, grads = _value_and_grads(whole, hidden, weight, bias, targets, coefficients)
        chunked = lambda h, w, b, t: head_logprobs(h, t, w, b, chunk_rows=3)  # noqa: E731
        chunked_value, chunked_grads = _value_and_grads(chunked, hidden, weight, bias, targets, coefficients)
    assert value.dtype == torch.float32 and torch.equal(value, expected) and torch.equal(chunked_value, expected)
    for grad, reference in zip(grads, expected_grads, strict=True):  # one chunk: autocast's ops, one by one
        assert grad.dtype == reference.dtype and _rel(grad, reference) <= 1e-6
    for grad, reference in zip(chunked_grads, expected_grads, strict=True):
        assert _rel(grad, reference) <= BF16_TOLERANCE
    assert _rel(chunked_grads[0], expected_grads[0]) <= 1e-6  # rows are never summed over: exact up to float32


def test_no_rows_score_nothing():
    hidden, weight, bias, targets, _ = _inputs(torch.float64)
    logp = head_logprobs(hidden[:0], targets[:0], weight, bias, chunk_rows=4)
    assert logp.shape == (0,) and logp.dtype == torch.float64
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        head_logprobs(hidden, targets, weight, bias, chunk_rows=0)


def test_the_backward_keeps_the_hidden_rows_and_recomputes_one_chunk_of_logits_at_a_time():
    """Saved tensors, forward and backward: nothing of rows × V; one chunk's logits at most (counted with
    saved-tensor hooks, as ``tslightning plan`` counts them)."""
    hidden, weight, bias, targets, coefficients = _inputs(torch.float64)
    saved: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        head = {t.untyped_storage().data_ptr() for t in (weight, bias)}
        if tensor.untyped_storage().data_ptr() not in head:  # the head's parameters (the backward's leaves alias them)
            saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logp = head_logprobs(hidden, targets, weight, bias, chunk_rows=4)
        forward = list(saved)
        torch.autograd.grad((logp * coefficients).sum(), [hidden, weight, bias])
    assert sorted(forward) == [(ROWS,), (ROWS, HIDDEN)]  # the targets and the hidden rows
    assert max(torch.Size(shape).numel() for shape in saved) <= 4 * VOCAB
    full: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: full.append(tuple(t.shape)) or t, lambda t: t):
        _full(hidden, weight, bias, targets)
    assert (ROWS, VOCAB) in full  # the full-logits path saves all rows' log-softmax
