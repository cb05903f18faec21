"""A backward whose parameter gradients arrive unit by unit, each exactly autograd.grad's, never all at once."""

from __future__ import annotations

import pytest
import torch

from tslightning.core.gradient_units import fold_order, gradient_units
from tslightning.core.unit_backward import UnitBackward
from tslightning.objectives.scored_logprobs import scored_logprobs


@pytest.fixture
def policy(make_policy):
    return make_policy(torch.float64)


def _score(policy, vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (24,), generator=generator)
    mask = torch.zeros(24, dtype=torch.bool)
    mask[10:] = True
    return scored_logprobs(policy, tokens, mask).sum()


def test_units_are_the_decoder_blocks_and_every_other_parameter_alone(policy):
    parameters = [p for p in policy.parameters() if p.requires_grad]
    units = gradient_units(policy, parameters)
    assert sorted(i for unit in units for i in unit) == list(range(len(parameters)))
    blocks = [unit for unit in units if len(unit) > 1]
    assert len(blocks) == policy.config.num_hidden_layers  # one unit per decoder block
    names = [n for n, p in policy.named_parameters() if p.requires_grad]
    for unit in blocks:
        assert len({names[i].split(".")[2] for i in unit}) == 1  # model.layers.<i>.*
    assert fold_order(units) == list(range(len(units) - 1, -1, -1))


def test_each_unit_is_folded_once_in_the_fold_order_with_autograds_gradient(policy, vocab_size):
    parameters = [p for p in policy.parameters() if p.requires_grad]
    expected = torch.autograd.grad(_score(policy, vocab_size), parameters)
    units = gradient_units(policy, parameters)
    backward = UnitBackward(units)
    folded: list[tuple[int, dict[int, torch.Tensor]]] = []
    backward.run([_score(policy, vocab_size)], parameters, lambda u, grads: folded.append((u, grads)))
    assert [u for u, _ in folded] == backward.order  # every unit once, last unit first
    for unit, grads in folded:
        assert sorted(grads) == units[unit]
        for index, grad in grads.items():
            assert torch.equal(grad, expected[index])  # bit for bit what autograd.grad returns
    largest = max(sum(parameters[i].numel() for i in unit) for unit in units)
    assert backward.peak_live_numel == largest < sum(p.numel() for p in parameters)  # one unit at a time


def test_inputs_get_their_gradients_and_outputs_without_a_graph_fold_empty_units(policy, vocab_size):
    parameters = [p for p in policy.parameters() if p.requires_grad]
    leaf = torch.ones(3, dtype=torch.float64, requires_grad=True)
    units = gradient_units(policy, parameters)
    folded = []
    (grad,) = UnitBackward(units).run(
        [_score(policy, vocab_size) + (leaf * 2).sum()], parameters, lambda u, g: folded.append(u), inputs=[leaf]
    )
    assert torch.equal(grad, torch.full((3,), 2.0, dtype=torch.float64))
    empty = []
    (unused,) = UnitBackward(units).run([torch.ones(())], parameters, lambda u, g: empty.append(g), inputs=[leaf])
    assert torch.equal(unused, torch.zeros(3, dtype=torch.float64)) and empty == [{}] * len(units)


def test_a_fold_that_raises_stops_the_backward_and_leaves_no_hook_behind(policy, vocab_size):
    parameters = [p for p in policy.parameters() if p.requires_grad]

    def fail(unit, grads):
        raise RuntimeError("fold failed")

    expected = torch.autograd.grad(_score(policy, vocab_size), parameters)
    with pytest.raises(RuntimeError, match="fold failed"):
        UnitBackward(gradient_units(policy, parameters)).run([_score(policy, vocab_size)], parameters, fail)
    after = torch.autograd.grad(_score(policy, vocab_size), parameters)  # no stale hook swallows these
    assert all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))
