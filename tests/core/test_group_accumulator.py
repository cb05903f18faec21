"""The statistics' stated precision bound: float32 statistics against the exact (float64) Σ_G g_G, coordinate by
coordinate, on real per-source gradients of the tiny transformer."""

from __future__ import annotations

import torch

from tslightning.core.group_accumulator import GroupAccumulator
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.objectives.advantages import GRPO_EPSILON, AdvantageEstimator, advantage_scale, group_mean
from tslightning.objectives.scored_logprobs import scored_logprobs

UNIT_ROUNDOFF = 2.0**-24


def _source_gradients(policy, vocab_size: int, count: int) -> list[torch.Tensor]:
    layout = ParameterLayout(policy.parameters())
    generator = torch.Generator().manual_seed(5)
    grads = []
    for _ in range(count):
        length = int(torch.randint(12, 40, (1,), generator=generator))
        tokens = torch.randint(0, vocab_size, (length,), generator=generator)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 2 :] = True
        score = scored_logprobs(policy, tokens, mask).sum() / mask.sum()
        grads.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(score, layout.parameters)]))
    return grads


def test_float32_statistics_stay_within_the_stated_bound(make_policy, vocab_size):
    policy = make_policy(torch.float64)
    m, groups = 6, 3
    grads = _source_gradients(policy, vocab_size, m * groups)
    rewards = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.25, 0.75] * groups).tolist()
    layout = ParameterLayout(policy.parameters())
    accumulator = GroupAccumulator(layout, dtype=torch.float32)
    exact = torch.zeros(layout.numel, dtype=torch.float64)
    magnitude = torch.zeros(layout.numel, dtype=torch.float64)
    for g in range(groups):
        members = range(g * m, (g + 1) * m)
        for i in members:
            accumulator.add_flat(f"g{g}", m, rewards[i], grads[i].float())
        reduction = accumulator.close(f"g{g}")
        group_rewards = [rewards[i] for i in members]
        alpha = advantage_scale(group_rewards, AdvantageEstimator.GRPO, GRPO_EPSILON) / m
        mu, shift = group_mean(group_rewards), group_rewards[0]
        beta = -alpha * (mu - shift)
        for i in members:
            exact += alpha * (rewards[i] - mu) * grads[i]
            magnitude += (abs(alpha * (rewards[i] - shift)) + abs(beta)) * grads[i].abs()
        assert reduction.scale == advantage_scale(group_rewards, AdvantageEstimator.GRPO, GRPO_EPSILON)
    error = (accumulator.batch.double() - exact).abs()
    bound = (m + groups + 3) * UNIT_ROUNDOFF * magnitude
    assert bool((error <= bound).all()), float((error / bound.clamp_min(1e-300)).max())
    assert float(error.max()) > 0  # float32 did round: the bound is tested, not vacuous
    relative = float((accumulator.batch.double() - exact).norm() / exact.norm())
    print(f"float32 statistics: relative error {relative:.2e}, worst coordinate at {float((error / bound).max()):.2f}")
