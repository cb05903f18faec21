"""Padded learner passes over several sources at once: the ``sync`` schedule's micro-batches, and under
``thundersync`` a backlog of sources that became ready while the learner was busy — exactly the same update.

A pass runs one forward over up to ``size`` causal sequences (padded, longest first) and one backward of the weighted
sum of their scores; its gradient folds into one place (:class:`~tslightning.core.contribution.Contribution`):

* the batch accumulator, when every weight is final: the ``sync`` schedule's A_i / (m·P·L_i) (Eq. 6 with App.
  D.1's token weights), a backlog source of a GRPO group whose m rewards are all known by now (its group's other
  sources may have been folded into G1'/G2 before: the group's close adds their part), or an OPD turn (Eq. 8's
  unnormalized g_j, Eq. 9 divides at the barrier);
* an open GRPO group's statistics (Eq. 7): a pass takes sources of one group *with one reward* r, so its gradient
  Σ_i H_i folds as G1' += (r − c)·ΣH_i and G2 += ΣH_i — the two running sums need no second backward.

Every source is counted in its group once, after its pass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.contribution import BATCH, Contribution
from tslightning.core.sources import Source, TrajectorySource
from tslightning.learner.sync_direction import micro_batches, trajectory_coefficients
from tslightning.objectives.advantages import AdvantageEstimator

__all__ = ["BatchedPass", "backlog_passes", "turn_passes"]


@dataclass(frozen=True)
class BatchedPass:
    """One padded pass: its rows (one per causal sequence) and their objective weights, where its gradient folds, and
    the GRPO sources it counts in their groups afterwards.

    Attributes:
        rows: One source-shaped row per causal sequence (a trajectory of several sequences may span several passes);
            the release trace records each row served over the pass's interval (shared by tokens).
        weights: Each row's weight in the pass's objective Σ_row weight·S_row.
        contribution: Where the gradient folds (``BATCH``, or an open group's with the pass's shared reward).
        counted: Sources counted in their open group's statistics once the pass folded (last pass of its chunk).
        direct: Sources of complete groups whose final terms are in the batch once this pass folded (each counted
            once, in the last pass holding one of its rows).
    """

    rows: list[Source]
    weights: list[float]
    contribution: Contribution
    counted: list[TrajectorySource] = field(default_factory=list)
    direct: list[TrajectorySource] = field(default_factory=list)


def backlog_passes(
    sources: Sequence[TrajectorySource],
    plan: BatchPlan,
    group_rewards: Mapping[str, Mapping[int, float]],
    estimator: AdvantageEstimator,
    epsilon: float,
    size: int,
    max_tokens: int | None = None,
) -> list[BatchedPass]:
    """The passes serving GRPO ``sources`` (ready at once, in readiness order) in micro-batches of ``size`` rows and
    at most ``max_tokens`` padded tokens.

    ``group_rewards`` holds every group whose m rewards are all known (trajectory index → reward): its sources get
    their final weights A_i / (m·P·L_i) and fold into the batch, several groups per pass; the other sources are served
    per (group, reward) with weights 1/(P·L_i), folded into that group's statistics.
    """
    complete = [s for s in sources if s.group_id in group_rewards]
    passes = []
    if complete:
        coefficients, _ = trajectory_coefficients(complete, plan, estimator, epsilon, dict(group_rewards))
        batches = micro_batches(complete, coefficients, size, max_tokens)
        last = {_key(row): index for index, (rows, _) in enumerate(batches) for row in rows}
        for index, (rows, weights) in enumerate(batches):
            direct = [s for s in complete if last[_key(s)] == index]
            passes.append(BatchedPass(rows, weights, BATCH, direct=direct))
    chunks: dict[tuple[str, float], list[TrajectorySource]] = {}
    for source in sources:
        if source.group_id not in group_rewards:
            chunks.setdefault((source.group_id, source.reward), []).append(source)
    for (group_id, reward), chunk in chunks.items():
        contribution = Contribution(group_id, plan.group_sizes[group_id], reward, completes=False)
        weights = [1.0 / (plan.num_prompts * s.num_scored) for s in chunk]
        batches = micro_batches(chunk, weights, size, max_tokens)
        for index, (rows, row_weights) in enumerate(batches):
            counted = chunk if index == len(batches) - 1 else []  # every row of the chunk folded: count them
            passes.append(BatchedPass(rows, row_weights, contribution, counted))
    return passes


def turn_passes(turns: Sequence[Source], size: int, max_tokens: int | None = None) -> list[BatchedPass]:
    """OPD turns ready at once, in padded passes of ``size`` rows and at most ``max_tokens`` padded tokens (each g_j
    has weight 1; Eq. 9 normalizes at the barrier)."""
    batches = micro_batches(list(turns), [1.0] * len(turns), size, max_tokens)
    return [BatchedPass(rows, weights, BATCH) for rows, weights in batches]


def _key(source: Source) -> tuple[str, int]:
    return source.group_id, source.trajectory_index
