"""A harness attempt's trajectory: the gateway's calls as turns, cut into segments where the harness rewrote history.

Each answered call is one turn (:class:`~tslightning.rollout.agent_loop.AgentTurn`): its sampled ids and their
log-probs (scored), at the policy version that sampled them. A call that continues its segment
(:mod:`~tslightning.rollout.gateway.conversation`) fixes the previous turn's observation: the ids it added after
the previous turn's sampled ids (tool output, message headers; unscored context). A call that does not starts a new
segment, whose prompt is that call's whole prompt.

**How segments are scored.** A sampled token's log-probability is only meaningful under the context the server
sampled it in, so each segment is scored as its own causal sequence: its first prompt, then its turns' sampled ids
and observations (:meth:`HarnessTrajectory.segment_sequence`). An OPD source is one turn under its realized history
(Eq. 8), which is its own segment's prefix: segmented trajectories train exactly, turn by turn
(:meth:`HarnessTrajectory.token_ids`). A GRPO source is one trajectory (Eq. 4): its first segment is the source's
sequence and every later one is one of its :attr:`~tslightning.core.sources.TrajectorySource.segments`, so
S_i = Σ_s Σ_{t∈M_{i,s}} log π(a_t | h_{i,s,t}) / (P·L_i) with L_i counting every segment's scored tokens, folded with
r_i once (the learner runs one pass per segment and counts the source at its last) — the exact update of the paper's
objective over everything sampled, each token under the context it was sampled in, never a stand-in context.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from tslightning.core.sources import TrajectorySource
from tslightning.rollout.agent_loop import AgentTrajectory, AgentTurn
from tslightning.rollout.engine import Generation
from tslightning.rollout.gateway.conversation import Continuation

__all__ = ["HarnessReply", "HarnessTrajectory"]


@dataclass(frozen=True)
class HarnessReply:
    """A turn's action as the harness received it: the text of the sampled ids (the harness parses it itself)."""

    text: str


@dataclass
class HarnessTrajectory(AgentTrajectory):
    """An :class:`~tslightning.rollout.agent_loop.AgentTrajectory` made of gateway calls, possibly in segments.

    Attributes:
        segment_starts: The index of each segment's first turn (``[0]`` once a call was answered).
        segment_prompts: Each segment's first prompt ids (``segment_prompts[0] == prompt_token_ids``).
    """

    segment_starts: list[int] = field(default_factory=list)
    segment_prompts: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def segments(self) -> int:
        return len(self.segment_starts)

    def add_turn(self, continuation: Continuation, generation: Generation, reply: str, seconds: float) -> AgentTurn:
        """Record one answered call: fix the previous turn's observation (a continuation) or open a segment."""
        index = len(self.turns)
        if continuation.new_segment:
            if not self.segment_starts:
                self.prompt_token_ids = continuation.prompt_ids
            self.segment_starts.append(index)
            self.segment_prompts.append(continuation.prompt_ids)
        else:
            previous = self.turns[-1]
            self.turns[-1] = dataclasses.replace(previous, observation_token_ids=continuation.new_ids)
        turn = AgentTurn(
            index,
            len(continuation.prompt_ids),
            generation.token_ids,
            generation.logprobs,
            (),
            HarnessReply(reply),
            generation.policy_version,
            generation.finish_reason,
            seconds,
            0.0,
            generation.speculation,
        )
        self.turns.append(turn)
        return turn

    def token_ids(self, through_turn: int | None = None) -> torch.Tensor:
        """The trajectory's ids (one segment), or with ``through_turn=j`` the history the server sampled turn j in:
        its segment's prompt, the segment's earlier turns with their observations, and turn j's sampled ids."""
        if through_turn is None:
            self._require_one_segment()
            return super().token_ids()
        pieces = [self.segment_prompts[self._segment_of(through_turn)]]
        for turn in self.turns[self.segment_starts[self._segment_of(through_turn)] : through_turn + 1]:
            pieces.append(turn.action_token_ids)
            if turn.index < through_turn:
                pieces.append(turn.observation_token_ids)
        return torch.tensor([t for piece in pieces for t in piece], dtype=torch.long)

    def scored_mask(self, only_turn: int | None = None) -> torch.Tensor:
        """True on sampled ids: every turn's (one segment), or only turn j's within the history of
        :meth:`token_ids` (``through_turn=j``)."""
        if only_turn is None:
            self._require_one_segment()
            return super().scored_mask()
        start = self.segment_starts[self._segment_of(only_turn)]
        pieces = [torch.zeros(len(self.segment_prompts[self._segment_of(only_turn)]), dtype=torch.bool)]
        for turn in self.turns[start : only_turn + 1]:
            pieces.append(torch.full((len(turn.action_token_ids),), turn.index == only_turn, dtype=torch.bool))
            if turn.index < only_turn:
                pieces.append(torch.zeros(len(turn.observation_token_ids), dtype=torch.bool))
        return torch.cat(pieces)

    def segment_sequence(self, segment: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment ``segment`` as a causal sequence and its scored mask: its first prompt (unscored), then each of its
        turns' sampled ids (scored) and observation (unscored)."""
        start = self.segment_starts[segment]
        end = self.segment_starts[segment + 1] if segment + 1 < self.segments else len(self.turns)
        ids, mask = list(self.segment_prompts[segment]), [False] * len(self.segment_prompts[segment])
        for turn in self.turns[start:end]:
            ids += [*turn.action_token_ids, *turn.observation_token_ids]
            mask += [True] * len(turn.action_token_ids) + [False] * len(turn.observation_token_ids)
        return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)

    def trajectory_source(self) -> TrajectorySource:
        """The GRPO source (Eq. 4), ready once :attr:`reward` is set: its first segment, then every later one as one
        of its ``segments`` (see the module docstring)."""
        if self.segments <= 1:
            return super().trajectory_source()
        if self.reward is None:
            raise ValueError(f"trajectory ({self.group_id!r}, {self.trajectory_index}) has no reward yet")
        (ids, mask), *later = (self.segment_sequence(s) for s in range(self.segments))
        prompt = len(self.segment_prompts[0])
        return TrajectorySource(
            self.group_id, self.trajectory_index, ids, mask, self.reward, self.policy_version, prompt, tuple(later)
        )

    def _segment_of(self, turn: int) -> int:
        if not 0 <= turn < len(self.turns):
            raise IndexError(f"trajectory ({self.group_id!r}, {self.trajectory_index}) has no turn {turn}")
        return max(s for s, start in enumerate(self.segment_starts) if start <= turn)

    def _require_one_segment(self) -> None:
        if self.segments != 1:
            raise ValueError(
                f"trajectory ({self.group_id!r}, {self.trajectory_index}) has {self.segments} segments; as one token "
                "sequence it exists only with one segment (score a segmented trajectory turn by turn)"
            )
