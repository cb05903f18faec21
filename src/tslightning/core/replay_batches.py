"""Recorded logical batches and their readiness orders, for replaying one batch under several schedules (App. G).

A :class:`ReplayBatch` holds a :class:`~tslightning.core.batch_registry.BatchPlan` and its stream items (sources and
completion events). :meth:`ReplayBatch.reordered` draws a new readiness order that any real rollout could produce:
sources in any order, a trajectory closing after its turns, a group after its trajectories, the batch last.

:func:`synthetic_grpo_batch` and :func:`synthetic_opd_batch` build workloads with the structure the paper's
batches have — groups sharing a prompt, multi-turn trajectories with scored actions and unscored observations,
varied lengths, a uniform-reward group — from random token ids, so no dataset or download is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import (
    BatchClosed,
    GroupClosed,
    StreamItem,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)
from tslightning.objectives.scored_logprobs import scored_logprobs


@dataclass(frozen=True)
class WorkloadShape:
    """Sizes of a synthetic logical batch; token counts are inclusive ``(low, high)`` ranges."""

    num_groups: int = 3
    group_size: int = 4
    max_turns: int = 3
    prompt_tokens: tuple[int, int] = (6, 14)
    action_tokens: tuple[int, int] = (2, 9)
    observation_tokens: tuple[int, int] = (2, 10)
    uniform_groups: int = 1
    """GRPO: how many groups get one reward for every trajectory (they must contribute exactly zero)."""


@dataclass(frozen=True)
class ReplayBatch:
    """One logical batch as recorded: its plan and its stream items in one readiness order."""

    plan: BatchPlan
    items: tuple[StreamItem, ...]

    def stream(self) -> Iterator[BatchPlan | StreamItem]:
        """The plan, then every item in order: what a rollout DataModule yields for this update."""
        yield self.plan
        yield from self.items

    def reordered(self, generator: torch.Generator) -> ReplayBatch:
        """The same batch in a random readiness order that respects completion dependencies."""
        ready: dict[tuple, float] = {}
        timed: list[tuple[float, int, StreamItem]] = []
        for position, item in enumerate(self.items):
            tau = self._ready_time(item, ready, generator)
            timed.append((tau, position, item))
        return replace(self, items=tuple(item for _, _, item in sorted(timed, key=lambda t: (t[0], t[1]))))

    def with_version(self, policy_version: int) -> ReplayBatch:
        """The same batch stamped with another policy version (a replayed batch belongs to its update)."""
        items = tuple(
            replace(item, policy_version=policy_version) if hasattr(item, "policy_version") else item
            for item in self.items
        )
        return ReplayBatch(replace(self.plan, policy_version=policy_version), items)

    @staticmethod
    def _ready_time(item: StreamItem, ready: dict[tuple, float], generator: torch.Generator) -> float:
        def later(*deps: float) -> float:
            return max(deps, default=0.0) + float(torch.rand((), generator=generator, dtype=torch.float64)) * 0.2

        if isinstance(item, TrajectorySource | TurnSource):
            tau = float(torch.rand((), generator=generator, dtype=torch.float64))
            trajectory = (item.group_id, item.trajectory_index)
            ready[trajectory] = max(ready.get(trajectory, 0.0), tau)
            ready[(item.group_id,)] = max(ready.get((item.group_id,), 0.0), tau)
            return tau
        if isinstance(item, TrajectoryClosed):
            tau = later(ready.get((item.group_id, item.trajectory_index), 0.0))
            ready[(item.group_id,)] = max(ready.get((item.group_id,), 0.0), tau)
            return tau
        if isinstance(item, GroupClosed):
            return later(ready.get((item.group_id,), 0.0))
        return float("inf")


def _randint(bounds: tuple[int, int], generator: torch.Generator) -> int:
    return int(torch.randint(bounds[0], bounds[1] + 1, (), generator=generator))


def _tokens(count: int, vocab_size: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, vocab_size, (count,), generator=generator)


def _trajectory(prompt: torch.Tensor, shape: WorkloadShape, vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Token segments ``[prompt, action_0, observation_0, action_1, ...]``; actions at odd positions."""
    segments = [prompt]
    turns = _randint((1, shape.max_turns), gen)
    for turn in range(turns):
        segments.append(_tokens(_randint(shape.action_tokens, gen), vocab, gen))
        if turn < turns - 1:
            segments.append(_tokens(_randint(shape.observation_tokens, gen), vocab, gen))
    return segments


def _mask(segments: list[torch.Tensor], scored: set[int]) -> torch.Tensor:
    return torch.cat([torch.full((len(s),), i in scored, dtype=torch.bool) for i, s in enumerate(segments)])


def synthetic_grpo_batch(
    vocab_size: int, policy_version: int, generator: torch.Generator, shape: WorkloadShape | None = None
) -> ReplayBatch:
    """A GRPO batch: groups sharing a prompt, multi-turn trajectories, SETA-style rewards r = p + 0.5·1[p = 1]."""
    shape = shape or WorkloadShape()
    items: list[StreamItem] = []
    group_sizes = {}
    for g in range(shape.num_groups):
        group_id = f"group-{g}"
        group_sizes[group_id] = shape.group_size
        prompt = _tokens(_randint(shape.prompt_tokens, generator), vocab_size, generator)
        uniform_reward = 1.5 if g < shape.uniform_groups else None
        for i in range(shape.group_size):
            segments = _trajectory(prompt, shape, vocab_size, generator)
            passed = int(torch.randint(0, 5, (), generator=generator)) / 4
            reward = uniform_reward if uniform_reward is not None else passed + 0.5 * (passed == 1.0)
            actions = set(range(1, len(segments), 2))
            items.append(
                TrajectorySource(
                    group_id, i, torch.cat(segments), _mask(segments, actions), reward, policy_version, len(prompt)
                )
            )
        items.append(GroupClosed(group_id))
    items.append(BatchClosed(policy_version))
    return ReplayBatch(BatchPlan(Objective.GRPO, policy_version, group_sizes), tuple(items))


@torch.no_grad()
def synthetic_opd_batch(
    vocab_size: int,
    policy_version: int,
    generator: torch.Generator,
    teacher: torch.nn.Module,
    shape: WorkloadShape | None = None,
) -> ReplayBatch:
    """An OPD batch: every turn a source, scored by ``teacher`` under the turn's realized causal history."""
    shape = shape or WorkloadShape()
    items: list[StreamItem] = []
    group_sizes = {}
    for g in range(shape.num_groups):
        group_id = f"prompt-{g}"
        group_sizes[group_id] = shape.group_size
        prompt = _tokens(_randint(shape.prompt_tokens, generator), vocab_size, generator)
        for i in range(shape.group_size):
            segments = _trajectory(prompt, shape, vocab_size, generator)
            action_positions = list(range(1, len(segments), 2))
            for turn, position in enumerate(action_positions):
                history = segments[: position + 1]
                token_ids, mask = torch.cat(history), _mask(history, {position})
                teacher_logprobs = scored_logprobs(teacher, token_ids, mask).to(torch.float32).cpu()
                items.append(TurnSource(group_id, i, turn, token_ids, mask, teacher_logprobs, policy_version))
            items.append(TrajectoryClosed(group_id, i, len(action_positions)))
        items.append(GroupClosed(group_id))
    items.append(BatchClosed(policy_version))
    return ReplayBatch(BatchPlan(Objective.OPD, policy_version, group_sizes), tuple(items))
