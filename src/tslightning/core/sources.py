"""Objective sources and completion events: the units the learner streams (paper §3.2-3.4).

A *source* is one unit of learner work whose inputs are fixed: a GRPO trajectory once its reward arrives
(Eq. 4), or an OPD turn once the frozen teacher has scored its sampled action tokens (Eq. 8). *Completion
events* tell the learner that a trajectory, a group or the whole logical batch has no more sources coming.

Every record is validated when it is built; a bad field raises :class:`SourceError` naming the field and
the fix, before anything downstream has seen it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch


class SourceError(ValueError):
    """A source or completion event that cannot be used as given; the message names the field and the fix."""


class PolicyVersionError(SourceError):
    """A source stamped with a policy version other than the learner's snapshot θ_k (zero-staleness violation)."""


def _check_tokens(kind: str, token_ids: torch.Tensor, scored_mask: torch.Tensor) -> None:
    if (
        not isinstance(token_ids, torch.Tensor)
        or token_ids.dim() != 1
        or token_ids.dtype not in (torch.int32, torch.int64)
    ):
        raise SourceError(f"{kind}.token_ids must be a 1-D int32/int64 tensor of token ids; got {_describe(token_ids)}")
    if token_ids.numel() < 2:
        raise SourceError(
            f"{kind}.token_ids must hold at least 2 tokens (context + one action); got {token_ids.numel()}"
        )
    if int(token_ids.min()) < 0:
        raise SourceError(f"{kind}.token_ids contains a negative id; pass the engine's token ids unchanged")
    if not isinstance(scored_mask, torch.Tensor) or scored_mask.dtype != torch.bool or scored_mask.dim() != 1:
        raise SourceError(f"{kind}.scored_mask must be a 1-D bool tensor; got {_describe(scored_mask)}")
    if scored_mask.numel() != token_ids.numel():
        raise SourceError(
            f"{kind}.scored_mask has {scored_mask.numel()} entries but token_ids has {token_ids.numel()}; "
            "the mask must mark every token position (True on sampled action tokens)"
        )
    if not bool(scored_mask.any()):
        raise SourceError(f"{kind}.scored_mask scores no token; a source needs at least one sampled action token")
    if bool(scored_mask[0]):
        raise SourceError(f"{kind}.scored_mask[0] is True; the first token has no causal context and cannot be scored")


def check_int(kind: str, name: str, value: object, minimum: int = 0) -> None:
    """Raise :class:`SourceError` naming ``kind.name`` unless ``value`` is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SourceError(f"{kind}.{name} must be an int >= {minimum}; got {value!r}")


def _check_version(kind: str, policy_version: int) -> None:
    check_int(kind, "policy_version", policy_version)


def _as_reward(value: object) -> float | None:
    """``value`` as a finite Python float, or ``None``: a real number (Python, numpy scalar) or a one-element
    float/int tensor; never a bool, a complex number or a string."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy bools are not numbers.Real
        return None
    try:
        reward = float(value)
    except (OverflowError, TypeError, ValueError):  # an int too large for a float
        return None
    return reward if math.isfinite(reward) else None


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return type(value).__name__


@dataclass(frozen=True)
class TrajectorySource:
    """A GRPO source (Eq. 4): one sampled trajectory of a group, ready once its reward is fixed.

    Attributes:
        group_id: The prompt group the trajectory belongs to; its m trajectories share the prompt.
        trajectory_index: Index ``i`` of the trajectory within its group, ``0 <= i < m``.
        token_ids: ``(T,)`` integer ids of the whole trajectory: shared prompt, then every turn's action and
            observation tokens, exactly as the rollout engine produced them.
        scored_mask: ``(T,)`` bool, True on sampled action tokens (the set M_i of Eq. 4).
        reward: The trajectory's scalar reward r_i, finite; a numpy scalar or a one-element tensor is stored as the
            Python float it holds.
        policy_version: Version k of the policy θ_k that sampled the trajectory.
        prompt_length: Tokens ``[0, prompt_length)`` are the group's shared prompt (never scored).
        segments: Further causal sequences of the same trajectory, each ``(token_ids, scored_mask)``: where an agent
            harness rewrote its history, the turns after the rewrite were sampled under another context than
            ``token_ids``, and each is scored under its own (empty: one sequence, the built-in loop's). The source's
            score sums over every sequence, S_i = Σ_s Σ_{t∈M_{i,s}} log π(a_t | h_{i,s,t}), and L_i counts every
            sequence's scored tokens (Eq. 4 with w = 1/(P·L_i)).
    """

    group_id: str
    trajectory_index: int
    token_ids: torch.Tensor
    scored_mask: torch.Tensor
    reward: float
    policy_version: int
    prompt_length: int
    segments: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()

    def __post_init__(self) -> None:
        _check_tokens("TrajectorySource", self.token_ids, self.scored_mask)
        _check_version("TrajectorySource", self.policy_version)
        reward = _as_reward(self.reward)
        if reward is None:
            raise SourceError(
                f"TrajectorySource.reward must be a finite number (a float, an int, a numpy scalar or a one-element "
                f"tensor); got {self.reward!r}"
            )
        object.__setattr__(self, "reward", reward)
        check_int("TrajectorySource", "trajectory_index", self.trajectory_index)
        length = self.token_ids.numel()
        if (
            not isinstance(self.prompt_length, int)
            or isinstance(self.prompt_length, bool)
            or not 1 <= self.prompt_length < length
        ):
            raise SourceError(
                f"TrajectorySource.prompt_length must be an int in [1, {length}) (the shared prompt's token count); "
                f"got {self.prompt_length!r}"
            )
        if bool(self.scored_mask[: self.prompt_length].any()):
            raise SourceError("TrajectorySource.scored_mask marks prompt tokens; only sampled action tokens are scored")
        if not isinstance(self.segments, tuple) or not all(isinstance(s, tuple) and len(s) == 2 for s in self.segments):
            raise SourceError("TrajectorySource.segments must be a tuple of (token_ids, scored_mask) pairs")
        for index, (ids, mask) in enumerate(self.segments):
            _check_tokens(f"TrajectorySource.segments[{index}]", ids, mask)

    @property
    def sequences(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every causal sequence of the trajectory, ``(token_ids, scored_mask)``: the first, then :attr:`segments`."""
        return [(self.token_ids, self.scored_mask), *self.segments]

    @property
    def num_scored(self) -> int:
        """L_i, the number of scored action tokens (over every sequence)."""
        return sum(int(mask.sum()) for _, mask in self.sequences)

    @property
    def num_tokens(self) -> int:
        """Tokens of every sequence (what the learner's passes run)."""
        return sum(ids.numel() for ids, _ in self.sequences)


@dataclass(frozen=True)
class TurnSource:
    """An OPD source (Eq. 8): one agentic turn whose sampled action tokens the frozen teacher has scored.

    Attributes:
        group_id: The prompt the trajectory was sampled for (OPD samples are independent; the group only
            organizes registration and completion).
        trajectory_index: Index of the trajectory within its group.
        turn_index: Index of this source among its trajectory's turn sources, ``0, 1, ...``.
        token_ids: ``(T,)`` the turn's realized causal history (prompt, earlier turns with their retained
            observations) followed by this turn's tokens, exactly as serialized for the teacher.
        scored_mask: ``(T,)`` bool, True on this turn's sampled action tokens (M_j of Eq. 8).
        teacher_logprobs: ``(|M_j|,)`` log π_T(a_{j,t} | h_{j,t}) of each scored token, in position order.
        policy_version: Version k of the policy θ_k that sampled the turn.
    """

    group_id: str
    trajectory_index: int
    turn_index: int
    token_ids: torch.Tensor
    scored_mask: torch.Tensor
    teacher_logprobs: torch.Tensor
    policy_version: int

    def __post_init__(self) -> None:
        _check_tokens("TurnSource", self.token_ids, self.scored_mask)
        _check_version("TurnSource", self.policy_version)
        check_int("TurnSource", "trajectory_index", self.trajectory_index)
        check_int("TurnSource", "turn_index", self.turn_index)
        logprobs = self.teacher_logprobs
        if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 1 or not logprobs.is_floating_point():
            raise SourceError(f"TurnSource.teacher_logprobs must be a 1-D float tensor; got {_describe(logprobs)}")
        if logprobs.numel() != self.num_scored:
            raise SourceError(
                f"TurnSource.teacher_logprobs has {logprobs.numel()} entries but scored_mask marks {self.num_scored} "
                "tokens; the teacher must score exactly the turn's sampled action tokens"
            )
        if not bool(torch.isfinite(logprobs).all()):
            raise SourceError("TurnSource.teacher_logprobs contains NaN or inf; re-score the turn with the teacher")
        if bool((logprobs > 0).any()):
            raise SourceError("TurnSource.teacher_logprobs contains a positive value; pass log-probabilities (<= 0)")

    @property
    def num_scored(self) -> int:
        """|M_j|, the number of scored action tokens of the turn."""
        return int(self.scored_mask.sum())


@dataclass(frozen=True)
class TrajectoryClosed:
    """OPD completion event: trajectory ``(group_id, trajectory_index)`` emitted all of its turn sources.

    Attributes:
        num_turn_sources: How many :class:`TurnSource` records the trajectory emitted; the learner checks that
            exactly these arrived, so a lost turn is an error rather than a silently smaller batch.
    """

    group_id: str
    trajectory_index: int
    num_turn_sources: int

    def __post_init__(self) -> None:
        check_int("TrajectoryClosed", "trajectory_index", self.trajectory_index)
        # Every turn generates at least one token, so a finished trajectory emitted at least one turn source.
        check_int("TrajectoryClosed", "num_turn_sources", self.num_turn_sources, minimum=1)


@dataclass(frozen=True)
class GroupClosed:
    """Completion event: every trajectory of ``group_id`` is finished (GRPO: all m rewards are in)."""

    group_id: str


@dataclass(frozen=True)
class BatchClosed:
    """Completion event: the rollout side of logical batch ``policy_version`` has nothing more to send."""

    policy_version: int


Source = TrajectorySource | TurnSource
CompletionEvent = TrajectoryClosed | GroupClosed | BatchClosed
StreamItem = Source | CompletionEvent
