"""What one barrier did (:class:`UpdateResult`), when the learner served each source (:class:`ServiceRecord`, the
release trace's service intervals, App. B) and how long each phase of the update took (:class:`UpdateTimings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

from tslightning.core.group_accumulator import GroupReduction
from tslightning.core.sources import TrajectorySource, TurnSource


class UpdateTimings(TypedDict, total=False):
    """Seconds per phase of the current update k (App. B's step decomposition), host wall clock. The streaming
    module starts it at the batch's plan; the loop and callbacks add their phases. A phase that did not happen is
    absent (no publication: no ``publication_s``). Callbacks read it as a plain ``dict``, so a module of another
    project may keep one of its own with the same keys."""

    learner_service_s: float
    """Forward and backward passes of the update's sources (the ``sync`` schedule's, at the barrier, included)."""
    sync_s: float
    """``sync`` schedule: the learner work run at the barrier (part of ``learner_service_s``)."""
    barrier_s: float
    """Reduction, normalization, clipping and the optimizer step, without ``sync_s``."""
    rollout_wait_s: float
    """The learner waiting for the rollout with nothing to serve."""
    publication_s: float
    """θ_{k+1}'s publication until every replica acknowledged."""


@dataclass
class UpdateResult:
    """What one barrier did.

    Attributes:
        policy_version: k + 1, the version of the parameters after the step.
        direction_norm: Global L2 norm of the batch direction g_k before clipping.
        clip_coefficient: ‖applied .grad‖ / ‖g_k‖ as measured before the step: the module's own clipping, or a
            callback's run from ``before_step`` (a Trainer clips inside ``step``, after this is read: see the
            GradientClipping callback's metrics there).
        num_sources: Sources folded into the update (on this rank).
        num_scored_tokens: Scored action tokens (OPD: the global N_k of Eq. 9).
        groups: GRPO group reductions in the order they closed (empty for OPD).
        peak_held_numel: Peak accumulator values held on this rank during the update (App. D.3).
    """

    policy_version: int
    direction_norm: float
    clip_coefficient: float
    num_sources: int
    num_scored_tokens: int
    groups: list[GroupReduction] = field(default_factory=list)
    peak_held_numel: int = 0


@dataclass(frozen=True)
class ServiceRecord:
    """When the learner served one source (``time.perf_counter`` seconds) — the release trace's p_j (App. B).

    Under ``sync`` a padded micro-batch serves its sources together: each gets the micro-batch's start and end.
    """

    kind: str
    group_id: str
    trajectory_index: int
    turn_index: int | None
    policy_version: int
    tokens: int
    scored_tokens: int
    start: float
    end: float

    @classmethod
    def served(cls, source: TrajectorySource | TurnSource, start: float, end: float) -> ServiceRecord:
        """The record of ``source`` served from ``start`` to ``end``."""
        turn = source.turn_index if isinstance(source, TurnSource) else None
        return cls(
            type(source).__name__,
            source.group_id,
            source.trajectory_index,
            turn,
            source.policy_version,
            source.num_tokens if isinstance(source, TrajectorySource) else source.token_ids.numel(),
            source.num_scored,
            start,
            end,
        )
