"""The multi-turn agent loop: generate an action, run it in the sandbox, observe, repeat (App. D.2, Table 6).

Each attempt is one coroutine; generation goes through the engine's futures and tools run in worker threads, so
a trajectory waiting on a tool never blocks generation for the others. Token ids are never re-tokenized: the
trajectory is the prompt's ids followed, per turn, by the engine's sampled ids (scored) and the observation's
ids (unscored context), exactly what the learner and the teacher score.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tslightning.core.sources import TrajectorySource, TurnSource
from tslightning.rollout.action_parser import (
    ACTION_FORMAT_PROMPT,
    PARSER_ERROR_OBSERVATION,
    Action,
    Finish,
    ParseError,
    ShellCommand,
    parse_action,
)
from tslightning.rollout.engine import Generation, GenerationRequest, RolloutEngine, sampling_seed
from tslightning.rollout.observation import (
    ObservationWindow,
    keep_head_and_tail,
    keep_text_head_and_tail,
    status_line,
)
from tslightning.rollout.speculative import SpeculationStats


@dataclass(frozen=True)
class AgentLimits:
    """Per-attempt limits (Table 6); each is an independent ceiling and reaching one ends the attempt cleanly."""

    max_turns: int = 300
    max_tokens_per_turn: int = 1024
    max_tokens_per_trajectory: int = 16384
    max_prompt_tokens: int = 16384
    """Longer initial prompts are rejected before the attempt (excluded consistently across schedules)."""
    max_context_tokens: int = 131072
    observation: ObservationWindow = field(default_factory=ObservationWindow)
    temperature: float = 1.0
    observation_role: str = "tool"
    """Chat role the observation is serialized under."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_tokens_per_trajectory", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentLimits.{name} must be >= 1; got {getattr(self, name)}")
        if self.max_context_tokens <= self.max_prompt_tokens:
            raise ValueError("AgentLimits.max_context_tokens must exceed max_prompt_tokens to leave room for turns")


class PromptTooLong(ValueError):
    """An initial prompt over ``AgentLimits.max_prompt_tokens``; record and exclude the task, never truncate it."""


class CommandOutcome(Protocol):
    output: str
    exit_code: int | None
    timed_out: bool
    limit_hit: str | None


class TaskAttempt(Protocol):
    """One fresh task environment: where the agent's commands run and the verifier scores the result."""

    def run_command(self, command: str) -> CommandOutcome: ...

    def verify(self) -> float: ...


@dataclass(frozen=True)
class AgentTurn:
    """One turn: the sampled action (scored) and the observation that follows it (unscored context)."""

    index: int
    context_length: int
    """Tokens of causal history before this turn's action."""
    action_token_ids: tuple[int, ...]
    action_logprobs: tuple[float, ...] | None
    """The engine's log-probs of the action tokens (``None``: sampled with speculative decoding, none trusted)."""
    observation_token_ids: tuple[int, ...]
    action: Action
    policy_version: int
    finish_reason: str
    generation_seconds: float
    tool_seconds: float
    speculation: SpeculationStats | None = None
    """What speculative decoding did for the action (``None``: sampled without)."""


@dataclass
class AgentTrajectory:
    """A finished (or in-progress) attempt, convertible into objective sources."""

    task_id: str
    group_id: str
    trajectory_index: int
    update: int
    prompt_token_ids: tuple[int, ...]
    turns: list[AgentTurn] = field(default_factory=list)
    end_reason: str = "running"
    reward: float | None = None
    teacher_logprobs: dict[int, torch.Tensor] = field(default_factory=dict)
    """OPD: the frozen teacher's log-probs of each scored turn's action tokens, by turn index."""

    @property
    def policy_version(self) -> int:
        """The version that sampled the first turn (zero-staleness schedules: every turn)."""
        return self.turns[0].policy_version

    def teacher_gap(self) -> tuple[float, int]:
        """OPD: Σ_t (log π_T − log π_θk) over the teacher-scored action tokens, and their count (Eq. 8's A); turns
        sampled with speculative decoding, whose engine log-probs are not trusted, count nothing."""
        total, count = 0.0, 0
        for index, teacher in self.teacher_logprobs.items():
            sampled = self.turns[index].action_logprobs
            if sampled is None:
                continue
            total += float(teacher.double().sum()) - sum(sampled)
            count += len(sampled)
        return total, count

    def generation_record(self, turn: int | None = None) -> dict[str, float | int | None]:
        """How the actions of the whole trajectory (or of turn ``turn``) were generated, for the release trace: the
        sampled tokens, the seconds their requests took, and speculative decoding's steps, drafted and accepted
        tokens (``None`` when no turn speculated)."""
        turns = self.turns if turn is None else [self.turns[turn]]
        speculated = [t.speculation for t in turns if t.speculation is not None]
        total = sum(speculated[1:], speculated[0]) if speculated else None
        return {
            "generated_tokens": sum(len(t.action_token_ids) for t in turns),
            "generation_s": sum(t.generation_seconds for t in turns),
            "spec_steps": None if total is None else total.steps,
            "spec_drafted": None if total is None else total.drafted,
            "spec_accepted": None if total is None else total.accepted,
        }

    def token_ids(self, through_turn: int | None = None) -> torch.Tensor:
        """Prompt and turns; with ``through_turn=j`` the history ending with turn j's action (for OPD)."""
        pieces = [self.prompt_token_ids]
        for turn in self.turns[: None if through_turn is None else through_turn + 1]:
            pieces.append(turn.action_token_ids)
            if through_turn is None or turn.index < through_turn:
                pieces.append(turn.observation_token_ids)
        return torch.tensor([t for piece in pieces for t in piece], dtype=torch.long)

    def scored_mask(self, only_turn: int | None = None) -> torch.Tensor:
        """True on action tokens (all turns, or only turn ``only_turn`` within its history)."""
        pieces = [torch.zeros(len(self.prompt_token_ids), dtype=torch.bool)]
        for turn in self.turns[: None if only_turn is None else only_turn + 1]:
            scored = only_turn is None or turn.index == only_turn
            pieces.append(torch.full((len(turn.action_token_ids),), scored, dtype=torch.bool))
            if only_turn is None or turn.index < only_turn:
                pieces.append(torch.zeros(len(turn.observation_token_ids), dtype=torch.bool))
        return torch.cat(pieces)

    def trajectory_source(self) -> TrajectorySource:
        """The GRPO source (Eq. 4): ready once :attr:`reward` is set."""
        if self.reward is None:
            raise ValueError(f"trajectory ({self.group_id!r}, {self.trajectory_index}) has no reward yet")
        return TrajectorySource(
            self.group_id,
            self.trajectory_index,
            self.token_ids(),
            self.scored_mask(),
            self.reward,
            self.policy_version,
            len(self.prompt_token_ids),
        )

    def turn_source(self, turn: int, teacher_logprobs: torch.Tensor) -> TurnSource:
        """The OPD source (Eq. 8) of turn ``turn``, scored by the teacher under its realized history."""
        return TurnSource(
            self.group_id,
            self.trajectory_index,
            turn,
            self.token_ids(through_turn=turn),
            self.scored_mask(only_turn=turn),
            teacher_logprobs,
            self.turns[turn].policy_version,
        )


TurnCallback = Callable[[AgentTrajectory, AgentTurn], None]


class AgentLoop:
    """Runs attempts of a shell agent against a :class:`RolloutEngine` under :class:`AgentLimits`.

    Args:
        engine: Where actions are sampled.
        tokenizer: The policy's tokenizer (chat template with an end-of-turn token as ``eos_token``).
        limits: Table 6 limits.
        run_seed: Seed of the run; sampling seeds derive from (run seed, update, task, trajectory, turn).
        system_prompt: Documents the action format to the policy.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        limits: AgentLimits | None = None,
        run_seed: int = 0,
        system_prompt: str = ACTION_FORMAT_PROMPT,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits or AgentLimits()
        self.run_seed = run_seed
        self.system_prompt = system_prompt
        self.end_of_turn = tokenizer.eos_token_id
        role = self.limits.observation_role
        self._observation_open = self._encode(f"\n<|im_start|>{role}\n")
        self._observation_close = self._encode("<|im_end|>\n<|im_start|>assistant\n")

    def prompt_token_ids(self, instruction: str) -> list[int]:
        """The chat-templated system + user prompt, ending with the assistant generation prompt.

        The instruction is stripped of surrounding whitespace (``instruction.md`` files end with a newline), so the
        same task always yields the same prompt ids wherever it is read from.
        """
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": instruction.strip()}]
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if len(ids) > self.limits.max_prompt_tokens:
            raise PromptTooLong(f"prompt has {len(ids)} tokens > max_prompt_tokens={self.limits.max_prompt_tokens}")
        return ids

    async def run(
        self,
        task_id: str,
        instruction: str,
        attempt: TaskAttempt,
        group_id: str,
        trajectory_index: int,
        update: int,
        on_turn: TurnCallback | None = None,
    ) -> AgentTrajectory:
        """Run one attempt to its end, then the verifier; returns the trajectory with its reward.

        ``on_turn`` is called as soon as a turn's action tokens are fixed (before its tool runs), which is when an
        OPD turn can go to the teacher.
        """
        trajectory = AgentTrajectory(
            task_id, group_id, trajectory_index, update, tuple(self.prompt_token_ids(instruction))
        )
        context = list(trajectory.prompt_token_ids)
        generated = 0
        while trajectory.end_reason == "running":
            budget, stop = self._turn_budget(len(trajectory.turns), generated, len(context))
            if stop:
                trajectory.end_reason = stop
                break
            turn = await self._turn(trajectory, attempt, context, budget, on_turn)
            generated += len(turn.action_token_ids)
            context += list(turn.action_token_ids) + list(turn.observation_token_ids)
        trajectory.reward = float(await asyncio.to_thread(attempt.verify)) if trajectory.turns else 0.0
        return trajectory

    def _turn_budget(self, turns: int, generated: int, context: int) -> tuple[int, str | None]:
        limits = self.limits
        if turns >= limits.max_turns:
            return 0, "max_turns"
        if generated >= limits.max_tokens_per_trajectory:
            return 0, "trajectory_token_limit"
        if context >= limits.max_context_tokens:
            return 0, "context_limit"
        return min(
            limits.max_tokens_per_turn,
            limits.max_tokens_per_trajectory - generated,
            limits.max_context_tokens - context,
        ), None

    async def _turn(
        self,
        trajectory: AgentTrajectory,
        attempt: TaskAttempt,
        context: list[int],
        budget: int,
        on_turn: TurnCallback | None,
    ) -> AgentTurn:
        index = len(trajectory.turns)
        request = GenerationRequest(
            request_id=f"{trajectory.group_id}/{trajectory.trajectory_index}/{index}",
            prompt_token_ids=tuple(context),
            max_tokens=budget,
            seed=sampling_seed(
                self.run_seed, trajectory.update, trajectory.task_id, trajectory.trajectory_index, index
            ),
            temperature=self.limits.temperature,
            stop_token_ids=(self.end_of_turn,),
            session=f"{trajectory.group_id}/{trajectory.trajectory_index}",
        )
        start = time.perf_counter()
        generation: Generation = await asyncio.wrap_future(self.engine.submit(request))
        generation_seconds = time.perf_counter() - start
        action = parse_action(self.tokenizer.decode(list(generation.token_ids), skip_special_tokens=True))
        partial = AgentTurn(
            index,
            len(context),
            generation.token_ids,
            generation.logprobs,
            (),
            action,
            generation.policy_version,
            generation.finish_reason,
            generation_seconds,
            0.0,
            generation.speculation,
        )
        trajectory.turns.append(partial)
        if on_turn is not None:
            on_turn(trajectory, partial)
        start = time.perf_counter()
        observation, end = await self._observe(action, attempt, generation, len(context))
        turn = AgentTurn(
            **{
                **partial.__dict__,
                "observation_token_ids": tuple(observation),
                "tool_seconds": time.perf_counter() - start,
            }
        )
        trajectory.turns[index] = turn
        if end:
            trajectory.end_reason = end
        return turn

    async def _observe(
        self, action: Action, attempt: TaskAttempt, generation: Generation, context: int
    ) -> tuple[list[int], str | None]:
        """The unscored tokens after an action and, if the attempt ends here, why."""
        closing = [] if generation.finish_reason == "stop" else [self.end_of_turn]  # close a cut-off turn
        if isinstance(action, Finish):
            return closing, "finished"
        if isinstance(action, ShellCommand):
            outcome = await asyncio.to_thread(attempt.run_command, action.command)
            output = outcome.output if outcome.output.endswith("\n") or not outcome.output else outcome.output + "\n"
            body, status = output, status_line(outcome.exit_code, outcome.timed_out, outcome.limit_hit)
        else:
            assert isinstance(action, ParseError)
            body, status = PARSER_ERROR_OBSERVATION, ""
        observation = closing + self.observation_tokens(body, status)
        if context + len(generation.token_ids) + len(observation) > self.limits.max_context_tokens:
            return closing, "context_limit"  # the observation would not fit; end without appending it
        return observation, None

    def observation_tokens(self, body: list[int] | str, status: list[int] | str = ()) -> list[int]:
        """The unscored tokens after a closed action: the observation message — ``body`` kept as head and tail
        (Table 6; text is tokenized only as far as the window needs, see ``keep_text_head_and_tail``), then
        ``status`` in full — and the next assistant header."""
        kept = self._body_tokens(body) if isinstance(body, str) else self._window(list(body))
        status = self._encode(status) if isinstance(status, str) else list(status)
        return self._observation_open + kept + status + self._observation_close

    def _body_tokens(self, text: str) -> list[int]:
        """``text``'s tokens as the observation window keeps them (already windowed)."""
        return keep_text_head_and_tail(text, self.limits.observation, self._encode, self._omission_marker)

    def _window(self, ids: list[int]) -> list[int]:
        kept, _ = keep_head_and_tail(ids, self.limits.observation, lambda omitted: self._omission_marker(omitted, 0))
        return kept

    def _omission_marker(self, omitted_tokens: int, omitted_chars: int) -> list[int]:
        if omitted_chars:
            return self._encode(f"\n[... {omitted_chars} characters and {omitted_tokens} tokens omitted ...]\n")
        return self._encode(f"\n[... {omitted_tokens} tokens omitted ...]\n")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))
