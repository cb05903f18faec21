"""AdamW with bfloat16 moments (Table 5): torch's AdamW update exactly when the moments are float32, within the
moments' rounding when they are bfloat16, half the state, checkpointed like any optimizer."""

from __future__ import annotations

import torch

from tslightning.learner.compact_adamw import CompactAdamW
from tslightning.learner.settings import OptimizerSettings
from tslightning.learner.streaming_module import StreamingPolicyModule


def _steps(optimizer_class, dtype: torch.dtype | None, steps: int = 5) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    generator = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(64, 32, generator=generator))
    settings = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    extra = {} if dtype is None else {"state_dtype": dtype}
    optimizer = optimizer_class([p], **settings, **extra)
    for _ in range(steps):
        p.grad = torch.randn(64, 32, generator=generator)
        optimizer.step()
    return p.detach().clone(), optimizer


def test_float32_moments_give_torch_adamw_bit_for_bit():
    theirs, _ = _steps(lambda params, **s: torch.optim.AdamW(params, **s, foreach=False), None)
    ours, _ = _steps(CompactAdamW, torch.float32)
    assert torch.equal(ours, theirs)


def test_bfloat16_moments_halve_the_state_and_stay_within_their_rounding():
    theirs, _ = _steps(lambda params, **s: torch.optim.AdamW(params, **s, foreach=False), None)
    ours, optimizer = _steps(CompactAdamW, torch.bfloat16)
    state = next(iter(optimizer.state.values()))
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
    start = _steps(CompactAdamW, torch.bfloat16, steps=0)[0]
    moved = (theirs - start).norm()
    assert 0 < float((ours - theirs).norm() / moved) < 2**-6  # the moments' 8-bit mantissa, not the update's


def test_the_state_round_trips_through_a_state_dict():
    _, optimizer = _steps(CompactAdamW, torch.bfloat16)
    p = optimizer.param_groups[0]["params"][0]
    fresh = CompactAdamW([p], lr=1e-3, state_dtype=torch.bfloat16)
    fresh.load_state_dict(optimizer.state_dict())
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(fresh.state[p][key], optimizer.state[p][key])


def test_the_module_builds_it_from_the_optimizer_settings(make_policy):
    module = StreamingPolicyModule(make_policy(torch.float32), optimizer=OptimizerSettings(state_dtype="bfloat16"))
    assert isinstance(module.configure_optimizers(), CompactAdamW)
    assert isinstance(StreamingPolicyModule(make_policy(torch.float32)).configure_optimizers(), torch.optim.AdamW)
