"""The batch-synchronous learner (schedule ``sync``, and ``async``'s learner): after the batch closed, batch-form
advantages (Eq. 6) and one padded objective per micro-batch, summed — the baseline streaming must equal.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.group_accumulator import GroupReduction
from tslightning.core.sources import Source, TrajectorySource
from tslightning.objectives.advantages import (
    AdvantageEstimator,
    advantage_scale,
    group_advantages,
    group_mean,
    is_uniform,
)
from tslightning.objectives.chunked_head import DEFAULT_CHUNK_ROWS
from tslightning.objectives.scored_logprobs import batched_scored_logprobs


def source_key(source: Source) -> tuple:
    """A source's place in the batch (group, trajectory, turn): the order the sync learner serves held sources in."""
    return (source.group_id, source.trajectory_index, getattr(source, "turn_index", 0))


def trajectory_coefficients(
    sources: list[TrajectorySource],
    plan: BatchPlan,
    estimator: AdvantageEstimator,
    epsilon: float,
    group_rewards: dict[str, dict[int, float]] | None = None,
) -> tuple[list[float], list[GroupReduction]]:
    """Per-trajectory weight A_i / (m · P · L_i) of the batch objective, with batch-form advantages (Eq. 6), and each
    group's reduction (in the order groups first appear in ``sources``).

    ``group_rewards`` (group → trajectory index → reward, all m of each group) gives the rewards of groups spread
    over ranks (:func:`tslightning.learner.spread_groups.global_rewards`); ``None``: ``sources`` hold whole groups.
    """
    by_group: dict[str, list[TrajectorySource]] = {}
    for s in sources:
        by_group.setdefault(s.group_id, []).append(s)
    weights: dict[tuple[str, int], float] = {}
    reductions = []
    for group_id, members in by_group.items():
        everyone = {s.trajectory_index: s.reward for s in members} if group_rewards is None else group_rewards[group_id]
        indices = sorted(everyone)
        rewards = [everyone[i] for i in indices]
        advantages = dict(zip(indices, group_advantages(rewards, estimator, epsilon).tolist(), strict=True))
        for s in members:
            weights[(group_id, s.trajectory_index)] = advantages[s.trajectory_index] / (
                len(rewards) * plan.num_prompts * s.num_scored
            )
        uniform = is_uniform(rewards)
        scale = 0.0 if uniform else advantage_scale(rewards, estimator, epsilon)
        reductions.append(GroupReduction(group_id, tuple(rewards), group_mean(rewards), scale, uniform))
    return [weights[(s.group_id, s.trajectory_index)] for s in sources], reductions


def sequence_rows(sources: list[Source], coefficients: list[float]) -> tuple[list[Source], list[float]]:
    """One padded row per causal sequence: a trajectory of several (a harness rewrote its history) becomes one row
    per sequence, each with the trajectory's coefficient (its score sums over them, Eq. 4)."""
    rows, weights = [], []
    for source, coefficient in zip(sources, coefficients, strict=True):
        if not (isinstance(source, TrajectorySource) and source.segments):
            rows.append(source)
            weights.append(coefficient)
            continue
        for index, (ids, mask) in enumerate(source.sequences):
            prompt = source.prompt_length if index == 0 else 1
            rows.append(replace(source, token_ids=ids, scored_mask=mask, prompt_length=prompt, segments=()))
            weights.append(coefficient)
    return rows, weights


def micro_batches(
    sources: list[Source], coefficients: list[float], size: int, max_tokens: int | None = None
) -> list[tuple[list[Source], list[float]]]:
    """``sources`` with their coefficients in padded micro-batches of ``size``, one row per causal sequence
    (:func:`sequence_rows`), longest first: each micro-batch then holds sequences of similar length, so the baseline
    wastes little compute on padding (verl's sequence balancing does the same). With ``max_tokens`` a micro-batch also
    holds at most that many padded tokens (rows × its longest row), but always one row."""
    sources, coefficients = sequence_rows(sources, coefficients)
    by_length = sorted(range(len(sources)), key=lambda i: (-sources[i].token_ids.numel(), i))
    batches: list[tuple[list[Source], list[float]]] = []
    for i in by_length:
        rows = batches[-1][0] if batches else []
        padded = (len(rows) + 1) * rows[0].token_ids.numel() if rows else 0
        if not rows or len(rows) == size or (max_tokens is not None and padded > max_tokens):
            batches.append(([], []))
        batches[-1][0].append(sources[i])
        batches[-1][1].append(coefficients[i])
    return batches


def batch_objective(
    policy: torch.nn.Module,
    objective: Objective,
    chunk: list[Source],
    weights: list[float],
    chunk_tokens: int = DEFAULT_CHUNK_ROWS,
) -> torch.Tensor:
    """One padded micro-batch's objective: GRPO Σ_i weight_i S_i; OPD App. I.2's ratio form (gradient of Eq. 8).
    The output head holds at most ``chunk_tokens`` rows of logits at a time."""
    ids, masks = [s.token_ids for s in chunk], [s.scored_mask for s in chunk]
    logps = batched_scored_logprobs(policy, ids, masks, chunk_tokens=chunk_tokens)
    if objective is Objective.GRPO:
        return sum(w * lp.sum() for w, lp in zip(weights, logps, strict=True))
    # ratio = exp(logp − logp.detach()) equals 1 and has the gradient of Eq. 8.
    return sum(
        (torch.exp(lp - lp.detach()) * (s.teacher_logprobs.to(lp) - lp.detach())).sum()
        for s, lp in zip(chunk, logps, strict=True)
    )
