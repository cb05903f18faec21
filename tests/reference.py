"""An independent reference written straight from the paper, sharing no code with the streaming learner.

Per trajectory Eq. 6 with ``torch.autograd.grad`` (GRPO); per turn Eq. 8-9 (OPD). Advantages are computed here
from their textbook definitions (population / sample std, leave-one-out mean), not from
tslightning.objectives.advantages.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-6


def _logprobs(model, token_ids, mask):
    ids = token_ids.long()[None]
    logits = model(input_ids=ids).logits[0]
    log_z = torch.logsumexp(logits[:-1], dim=-1)
    picked = logits[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    return (picked - log_z)[mask[1:]]


def _advantages(rewards: list[float], estimator: str) -> list[float]:
    m = len(rewards)
    if all(r == rewards[0] for r in rewards):
        return [0.0] * m
    mu = sum(rewards) / m
    if estimator == "grpo":
        sigma = math.sqrt(sum((r - mu) ** 2 for r in rewards) / m)
        return [(r - mu) / (sigma + EPS) for r in rewards]
    if estimator == "grpo_sample":
        sigma = math.sqrt(sum((r - mu) ** 2 for r in rewards) / (m - 1))
        return [(r - mu) / (sigma + EPS) for r in rewards]
    if estimator == "dr_grpo":
        return [r - mu for r in rewards]
    if estimator == "rloo":
        return [r - (sum(rewards) - r) / (m - 1) for r in rewards]
    raise ValueError(estimator)


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _flat(grads, params):
    filled = [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)]
    return torch.cat([g.reshape(-1) for g in filled])


def grpo_direction(model, batch, estimator: str = "grpo") -> torch.Tensor:
    """g_k = Σ_G (1/m) Σ_i A_i H_i, H_i = ∇ Σ_t w_{i,t} log π(a|h), w = 1/(P·L_i) (Eqs. 4-6, App. D.1)."""
    params = _params(model)
    sources = [s for s in batch.items if type(s).__name__ == "TrajectorySource"]
    num_prompts = len(batch.plan.group_sizes)
    direction = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for group_id in batch.plan.group_sizes:
        members = sorted((s for s in sources if s.group_id == group_id), key=lambda s: s.trajectory_index)
        advantages = _advantages([s.reward for s in members], estimator)
        for s, a in zip(members, advantages, strict=True):
            sequences = [(s.token_ids, s.scored_mask), *getattr(s, "segments", ())]  # Eq. 4 over every sequence
            scored = sum(int(mask.sum()) for _, mask in sequences)
            score = sum(_logprobs(model, ids, mask).sum() for ids, mask in sequences) / (num_prompts * scored)
            h = _flat(torch.autograd.grad(score, params, allow_unused=True), params)
            direction += (a / len(members)) * h.double()
    return direction


def opd_direction(model, batch) -> torch.Tensor:
    """g_k = (1/N_k) Σ_j Σ_t A_{j,t} ∇ log π(a_{j,t}|h_{j,t}), A = log π_T − log π_θk detached (Eqs. 8-9)."""
    params = _params(model)
    direction = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    tokens = 0
    for s in batch.items:
        if type(s).__name__ != "TurnSource":
            continue
        logp = _logprobs(model, s.token_ids, s.scored_mask)
        advantage = (s.teacher_logprobs.to(logp.dtype) - logp).detach()
        g_j = torch.autograd.grad((advantage * logp).sum(), params, allow_unused=True)  # one turn, Eq. 8
        direction += _flat(g_j, params).double()
        tokens += logp.numel()
    return direction / tokens


def with_rewritten_histories(batch, vocab_size: int, generator: torch.Generator, every: int = 2):
    """``batch`` with every ``every``-th trajectory given a second causal sequence, as an agent harness that rewrote
    its history leaves it: a new context (random ids) whose last tokens were sampled under it."""
    import dataclasses

    items = []
    for position, item in enumerate(batch.items):
        if type(item).__name__ == "TrajectorySource" and position % every == 0:
            length = int(torch.randint(8, 20, (1,), generator=generator))
            ids = torch.randint(0, vocab_size, (length,), generator=generator)
            mask = torch.zeros(length, dtype=torch.bool)
            mask[length // 2 :] = True
            item = dataclasses.replace(item, segments=((ids, mask),))
        items.append(item)
    return dataclasses.replace(batch, items=tuple(items))
