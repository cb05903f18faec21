"""A short supervised warm start on demonstration transcripts, so a tiny policy emits well-formed actions.

RL from a randomly initialized tiny model would never produce a parsable ``<bash>...</bash>`` action, so its
rewards would all be zero. The quickstart therefore first fits the policy to a few demonstrations — each task's
reference solution written as agent turns — with cross-entropy on the action tokens only. Transcripts are
serialized by :class:`~tslightning.rollout.agent_loop.AgentLoop`'s own prompt and observation format, so the
warm-started policy sees at RL time exactly the token layout it was fitted on. A harness trained through the
gateway brings its own layout instead (e.g. :class:`~tslightning.rollout.harness.mini_swe_agent.MiniSweAgentFormat`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from tslightning.rollout.agent_loop import AgentLoop
from tslightning.tasks.demonstrations import Demonstration


@dataclass
class WarmStartSettings:
    """A short supervised warm start on the tasks' reference solutions (0 steps: none)."""

    steps: int = 0
    """Optimizer steps, one demonstration each (0: no warm start). Skipped on ``--resume``: the checkpoint holds the
    warm-started and trained weights."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """``linear`` decays the learning rate to 0 over the steps, so the policy ends near the mix of demonstrations it
    was shown (a task's reference about ``reference_share`` of the time) rather than leaning toward the last few."""
    near_misses: bool = True
    """Also demonstrate each task's plausible wrong command, so sampled groups carry a reward spread to learn from."""
    reference_share: float | None = None
    """Probability that a warm-start step shows a reference solution rather than a near miss (``None``: every
    demonstration equally often: 0.5 for terminal tasks, one reference and one near miss each). With ``lr_schedule:
    linear`` policy-0 solves a task about this share of the time: lower leaves RL more to learn; near 0 or 1, fewer
    sampled groups carry a reward spread."""
    task_names: list[str] | None = None
    """Demonstrate these tasks of ``rollout.tasks`` (by directory name, either side of the split) instead of the
    training tasks. Held-out tasks named here stand in for what a pretrained policy already knows: RL never trains on
    them, so ``tslightning validate``'s dev split shows whether what RL learned carries over."""

    def problems(self) -> list[str]:
        """Everything out of range, each naming the key (``warm_start.*``) and the fix."""
        problems = [f"warm_start.steps must be >= 0; got {self.steps}"] if self.steps < 0 else []
        if self.task_names is not None and not self.task_names:
            problems.append("warm_start.task_names is empty: name at least one task, or null for the training tasks")
        if not self.lr > 0:
            problems.append(f"warm_start.lr must be > 0; got {self.lr}")
        if self.reference_share is not None and not 0 < self.reference_share < 1:
            problems.append(f"warm_start.reference_share must be in (0, 1) or null; got {self.reference_share}")
        if self.reference_share is not None and not self.near_misses:
            problems.append("warm_start.reference_share needs warm_start.near_misses: true (there is nothing to share)")
        return problems


class DemonstrationFormat(Protocol):
    """A harness's token layout of a demonstration (the layout its attempts reach the learner in)."""

    def demonstration_tokens(self, demo: Demonstration) -> tuple[torch.Tensor, torch.Tensor]: ...


def demonstration_tokens(loop: AgentLoop, demo: Demonstration) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(T,)`` and action mask ``(T,)`` of a demonstration in the agent loop's serialization."""
    ids = list(loop.prompt_token_ids(demo.instruction))
    mask = [False] * len(ids)
    for index, (action, observation) in enumerate(demo.turns):
        action_ids = loop.tokenizer.encode(action, add_special_tokens=False) + [loop.end_of_turn]
        ids += action_ids
        mask += [True] * len(action_ids)
        if index < len(demo.turns) - 1:
            observation_ids = loop.observation_tokens(observation)
            ids += observation_ids
            mask += [False] * len(observation_ids)
    return torch.tensor(ids), torch.tensor(mask)


def supervised_warm_start(
    model: torch.nn.Module,
    loop: AgentLoop | DemonstrationFormat,
    demonstrations: Sequence[Demonstration],
    steps: int = 200,
    lr: float = 3e-3,
    seed: int = 0,
    lr_schedule: str = "constant",
    reference_share: float | None = None,
) -> list[float]:
    """Fit ``model`` to the demonstrations' action tokens (AdamW, one demonstration per step, seeded order).

    Each step draws a demonstration uniformly, or, with ``reference_share``, a reference solution with that
    probability and a near miss otherwise (each uniformly among its kind).

    ``lr_schedule`` ``linear`` decays the learning rate to 0 over the steps: the policy then ends near the average
    of the demonstrations it was shown rather than leaning toward the last few (it chooses a task's reference about
    ``reference_share`` of the time, instead of a share that depends on the seed's order).

    ``loop`` lays the demonstrations out: the built-in agent loop's serialization, or a harness's format.

    Returns the loss of each step (mean negative log-likelihood per action token, nats). Leaves no gradient behind:
    every parameter's ``.grad`` is ``None`` afterwards.
    """
    if not demonstrations:
        raise ValueError("supervised_warm_start needs at least one demonstration")
    tokens = (lambda d: demonstration_tokens(loop, d)) if isinstance(loop, AgentLoop) else loop.demonstration_tokens
    examples = [tokens(d) for d in demonstrations]
    draw = _demonstration_draw(demonstrations, reference_share)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    decay = (lambda step: 1.0 - step / steps) if lr_schedule == "linear" else (lambda step: 1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
    order = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        index = (
            torch.randint(len(examples), (), generator=order)
            if draw is None
            else torch.multinomial(draw, 1, generator=order)
        )
        ids, mask = examples[int(index)]
        ids, mask = ids.to(device), mask.to(device)
        logits = model(input_ids=ids[None]).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits[mask[1:]].float(), ids[1:][mask[1:]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach().item())
    model.zero_grad(set_to_none=True)  # the RL learner accumulates into .grad: leave it nothing of the warm start
    model.eval()
    return losses


def _demonstration_draw(demonstrations: Sequence[Demonstration], reference_share: float | None) -> torch.Tensor | None:
    """Each demonstration's probability of being drawn at a step, ``(len(demonstrations),)`` float64; ``None``:
    uniform (no share, or demonstrations of one kind only)."""
    references = torch.tensor([d.reference for d in demonstrations], dtype=torch.float64)
    if reference_share is None or references.all() or not references.any():
        return None
    if not 0.0 < reference_share < 1.0:
        raise ValueError(f"reference_share must be in (0, 1); got {reference_share}")
    misses = 1.0 - references
    return reference_share * references / references.sum() + (1.0 - reference_share) * misses / misses.sum()
