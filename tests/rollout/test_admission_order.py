"""Longest-first admission: the likely stragglers start first, and exactly the same trajectories are sampled."""

from __future__ import annotations

import math
from types import SimpleNamespace

from fakes import ScriptedEngine
from test_rollout_datamodule import TASKS, attempt_factory

from tslightning.core.sources import TrajectorySource
from tslightning.rollout.admission_order import LengthHistory
from tslightning.rollout.rollout_datamodule import RolloutDataModule


class TaskLengthEngine(ScriptedEngine):
    """Task ``task-k``'s trajectories run 4 − k commands before finishing: tasks differ in length."""

    def submit(self, request):
        task = int(request.request_id.split("/")[2].removeprefix("task-"))
        trajectory = int(request.request_id.rsplit("/", 2)[1])
        self.replies = {trajectory: ["<bash>cat a b c</bash>"] * (4 - task) + ["<finish/>"]}
        return super().submit(request)


def trajectory(task_id: str, *tokens: int) -> SimpleNamespace:
    return SimpleNamespace(task_id=task_id, turns=[SimpleNamespace(action_token_ids=(0,) * n) for n in tokens])


def test_history_ranks_unknown_tasks_first_then_the_longest():
    history = LengthHistory()
    history.record([trajectory("short", 3), trajectory("long", 20, 20), trajectory("long", 10), trajectory("mid", 9)])
    assert history.predicted("long") == 25.0 and math.isinf(history.predicted("new"))
    groups = {"g-short": 1, "g-mid": 2, "g-new": 3, "g-long": 4}
    tasks = {"g-short": "short", "g-mid": "mid", "g-new": "new", "g-long": "long"}
    assert list(history.longest_first(groups, tasks)) == ["g-new", "g-long", "g-mid", "g-short"]


def _sampled(tokenizer, order: str) -> tuple[set, list, list]:
    engine = TaskLengthEngine(tokenizer, {})
    module = RolloutDataModule(
        engine, tokenizer, TASKS, attempt_factory(), "grpo", prompts_per_update=3, samples_per_prompt=3, run_seed=1,
        max_concurrent_attempts=2, admission_order=order,
    )  # fmt: skip
    sampled = set()
    for update in range(3):
        for item in module.stream_update(update):
            if isinstance(item, TrajectorySource):
                sampled.add((item.group_id, item.trajectory_index, tuple(item.token_ids.tolist())))
    seeds = sorted((r.request_id, r.seed, r.prompt_token_ids) for r in engine.requests)
    started = [r.request_id.rsplit("/", 2)[0] for r in engine.requests if r.request_id.startswith("u2/")]
    return sampled, seeds, list(dict.fromkeys(started))


def test_the_same_trajectories_are_sampled_in_either_order(tokenizer):
    task_order, task_seeds, task_starts = _sampled(tokenizer, "task")
    longest, longest_seeds, longest_starts = _sampled(tokenizer, "longest_first")
    assert longest == task_order and longest_seeds == task_seeds  # prompts, groups, seeds and every token
    assert longest_starts != task_starts and sorted(longest_starts) == sorted(task_starts)  # only the order moved
