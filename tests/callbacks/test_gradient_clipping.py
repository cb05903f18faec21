"""GradientClipping under a Trainer and Fabric: the module's own clipping exactly, and no step on a non-finite norm."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from harness import HOSTS, MemoryLogger, grpo_batch, run_updates
from torch.optim.optimizer import register_optimizer_step_post_hook

from tslightning.callbacks import GradientClipping
from tslightning.learner.streaming_module import StreamingPolicyModule

TORCH_CLIP_EPS = 1e-6


class SGDModule(StreamingPolicyModule):
    """SGD(lr=1): θ_1 − θ_0 is minus the ``.grad`` the optimizer saw, so any clipping difference shows in θ."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.layout.parameters, lr=1.0)


class PoisonGradient(L.Callback):
    """Ordered before GradientClipping: writes ``value`` into the batch direction in ``.grad``."""

    def __init__(self, value: float) -> None:
        self.value = value

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        optimizer.param_groups[0]["params"][0].grad.view(-1)[0] = self.value


@pytest.mark.parametrize("host", HOSTS)
def test_callback_clipping_equals_the_modules_own(make_policy, vocab_size, host, tmp_path):
    batch = grpo_batch(vocab_size)
    builtin = SGDModule(make_policy(), max_grad_norm=1.0)
    theta0 = builtin.layout.values()
    for item in batch.stream():
        builtin.ingest(item)
    norm = builtin.barrier(builtin.configure_optimizers()).direction_norm
    assert norm > 2.0, "the batch direction must exceed max_norm for clipping to act"

    module, clipping, logger = SGDModule(make_policy(), max_grad_norm=None), GradientClipping(1.0), MemoryLogger()
    run_updates(host, module, [batch], [clipping], logger, tmp_path)

    assert module.policy_version == 1
    assert torch.equal(module.layout.values(), builtin.layout.values())
    assert float((module.layout.values() - theta0).norm()) == pytest.approx(1.0, rel=2 * TORCH_CLIP_EPS)
    ((step, metrics),) = logger.having("actor/grad_clip_coef")
    assert step == 0
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-12)
    assert metrics["actor/grad_clip_coef"] == pytest.approx(1.0 / (norm + TORCH_CLIP_EPS), rel=1e-12)
    restored = GradientClipping(1.0)
    restored.load_state_dict(clipping.state_dict())
    assert restored.state_dict() == clipping.state_dict()
    assert clipping.state_dict() == {
        "updates": 1,
        "clipped_updates": 1,
        "last_grad_norm": metrics["actor/grad_norm"],
        "last_clip_coefficient": metrics["actor/grad_clip_coef"],
    }


@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("host", HOSTS)
def test_non_finite_direction_is_refused_without_a_step(make_policy, vocab_size, host, value, tmp_path):
    module, clipping, logger = (
        StreamingPolicyModule(make_policy(), max_grad_norm=None),
        GradientClipping(),
        MemoryLogger(),
    )
    theta0 = module.layout.values()
    steps = []
    handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
    try:
        with pytest.raises(FloatingPointError, match=r"update 0 \(θ_0 → θ_1\) has a non-finite .* refusing to step"):
            run_updates(host, module, [grpo_batch(vocab_size)], [PoisonGradient(value), clipping], logger, tmp_path)
    finally:
        handle.remove()
    assert steps == []
    assert torch.equal(module.layout.values(), theta0)
    assert module.policy_version == 0 and module.num_optimizer_steps == 0
    assert clipping.updates == 0 and logger.having("actor/grad_clip_coef") == []


def test_refuses_to_clip_what_the_module_already_clips(make_policy):
    module = StreamingPolicyModule(make_policy(), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="construct the module with max_grad_norm=None"):
        GradientClipping().on_before_optimizer_step(L.Fabric(accelerator="cpu", devices=1), module, None)


def test_bad_arguments_are_reported_together():
    with pytest.raises(ValueError, match=r"max_norm must be > 0 .*; norm_type must be > 0"):
        GradientClipping(max_norm=0.0, norm_type=-1.0)
