"""`fit`'s start-up: the training tasks, the policy (built or loaded, warm-started, saved for the engine), the rollout
engine, the OPD teacher and the rollout DataModule, and the learner's cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tslightning.learner.precision import compute_norms_in_float64
from tslightning.loop.settings import ModelSettings, RolloutSettings, settings_error
from tslightning.loop.warm_start import supervised_warm_start
from tslightning.models.tiny_model import load_tiny_model, save_tiny_model
from tslightning.rollout.agent_loop import AgentLimits, AgentLoop
from tslightning.rollout.observation import ObservationWindow
from tslightning.rollout.rollout_datamodule import RolloutDataModule
from tslightning.rollout.teacher import TeacherScorer
from tslightning.tasks.demonstrations import task_demonstrations
from tslightning.tasks.simulated_tool import SimulatedToolEnvironment, gauge_demonstrations, simulated_tasks
from tslightning.tasks.split import split_of
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TaskFormatError, TerminalTask, find_task_dirs
from tslightning.tasks.validation import library_dir


@dataclass
class TaskSelection:
    """The training tasks ``rollout`` selects, and what is wrong with the selection (each line names the key)."""

    tasks: list
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Problems that are a path that does not exist."""


def training_tasks(rollout: RolloutSettings) -> list:
    """The training tasks of ``rollout``; raises :class:`~tslightning.loop.settings.SettingsError` (a ``ValueError``
    or ``FileNotFoundError``) naming every problem."""
    selection = select_tasks(rollout)
    error = settings_error(selection.problems, selection.missing)
    if error is not None:
        raise error
    return selection.tasks


def select_tasks(rollout: RolloutSettings) -> TaskSelection:
    """Load ``rollout``'s tasks (only the named ones when ``task_names`` is given) and keep its split's side."""
    if rollout.environment == "simulated_tool":
        return _simulated_tasks(rollout)
    root = Path(rollout.tasks) if rollout.tasks else library_dir()
    if not root.is_dir():
        fix = "give a task directory or a directory of tasks (null: the shipped library)"
        return TaskSelection([], missing=[f"rollout.tasks {root} is not a directory; {fix}"])
    directories = find_task_dirs(root)
    selection = TaskSelection([])
    if not directories:
        selection.problems.append(f"rollout.tasks {root} holds no task (a directory with task.toml); point it at one")
    if rollout.task_names is not None:
        known = [d.name for d in directories]
        unknown = sorted(set(rollout.task_names) - set(known))
        if unknown and directories:
            selection.problems.append(f"rollout.task_names {unknown} are not tasks in {root} (it has {_few(known)})")
        directories = [d for d in directories if d.name in rollout.task_names]
    for directory in directories:
        try:
            selection.tasks.append(TerminalTask.load(directory))
        except TaskFormatError as error:
            selection.problems.append(
                f"rollout.tasks: task {directory.name!r} ({directory}) is not a valid Harbor task: "
                f"{'; '.join(error.problems)} (fix it, or leave it out with rollout.task_names)"
            )
    if rollout.split != "all" and 0 <= rollout.dev_fraction <= 1:  # out of range: RolloutSettings.problems says so
        selection.tasks = [t for t in selection.tasks if split_of(t.group_id, rollout.dev_fraction) == rollout.split]
    if not selection.tasks and not selection.problems:
        selection.problems.append(
            f"rollout.split={rollout.split!r} leaves no tasks in {root}; use split: all or more tasks"
        )
    return selection


def _simulated_tasks(rollout: RolloutSettings) -> TaskSelection:
    tasks = simulated_tasks(rollout.simulated_tool)
    if rollout.task_names is None:
        return TaskSelection(tasks)
    unknown = sorted(set(rollout.task_names) - {t.task_id for t in tasks})
    if unknown:
        return TaskSelection([], [f"rollout.task_names {unknown} are not simulated_tool tasks (gauge-0 ...)"])
    return TaskSelection([t for t in tasks if t.task_id in rollout.task_names])


def _few(names: list[str], shown: int = 6) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")


def prepare_policy(model, rollout, warm_start, tasks, seed: int, out: Path, resume: str | None = None):
    """Load (or build) the policy, warm-start it, and save it to ``out/policy-0``, where the rollout engine loads it.

    On ``resume`` there is no warm start: the checkpoint holds the warm-started and trained weights, restored into the
    learner and published to the replicas before update k + 1 samples anything. The run's own ``policy-0`` (its
    warm-started θ_0) is then kept as it is, and the engine starts from it.
    """
    source = Path(model.path) if model.path else save_tiny_model(out / "tiny-model", replace(model.tiny, seed=seed))
    policy, tokenizer = load_tiny_model(source)
    if warm_start.steps and resume is None:
        loop = AgentLoop(engine=None, tokenizer=tokenizer, limits=agent_limits(rollout))
        demos = demonstrations(rollout, tasks, warm_start.near_misses)
        supervised_warm_start(policy, loop, demos, steps=warm_start.steps, lr=warm_start.lr, seed=seed)
    policy_dir = out / "policy-0"
    if resume is None or not (policy_dir / "config.json").is_file():
        policy.save_pretrained(policy_dir)
        tokenizer.save_pretrained(policy_dir)
    policy = policy.to(getattr(torch, model.dtype))
    if model.dtype == "float64":
        compute_norms_in_float64(policy)
    if model.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = model.lora
        config = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
        )
        policy = get_peft_model(policy, config)
    return policy, tokenizer, policy_dir


def start_engine(rollout: RolloutSettings, policy_dir: Path, dtype: str):
    if rollout.engine == "vllm":
        from tslightning.rollout.vllm_engine import VLLMRolloutEngine

        if rollout.cpus is not None:
            raise ValueError("rollout.cpus places hf replicas; the in-process vllm engine shares the learner's cores")

        return VLLMRolloutEngine(policy_dir, dtype=dtype)
    from tslightning.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(
        policy_dir,
        dtype=dtype,
        replicas=rollout.replicas,
        cpus=rollout.cpus,
        max_batch_size=rollout.max_batch_size,
        prefix_cache_tokens=rollout.prefix_cache_tokens,
    )


def start_teacher(model: ModelSettings, rollout, warm_start, tasks, seed: int, out: Path) -> TeacherScorer:
    """The frozen OPD teacher: ``model.teacher_path``, or — for the embedded default — the tiny model warm-started
    twice as long on the reference solutions alone, so it prefers the right command the student only sometimes
    samples. Checkpoints do not hold the frozen teacher, so a resumed run warm-starts it again (seeded: the same
    teacher)."""
    if model.teacher_path:
        teacher, _ = load_tiny_model(model.teacher_path)
        return TeacherScorer(teacher, cpus=model.teacher_cpus)
    teacher, tokenizer = load_tiny_model(save_tiny_model(out / "tiny-model", replace(model.tiny, seed=seed)))
    if warm_start.steps:
        loop = AgentLoop(engine=None, tokenizer=tokenizer, limits=agent_limits(rollout))
        demos = demonstrations(rollout, tasks, near_misses=False)
        supervised_warm_start(teacher, loop, demos, steps=2 * warm_start.steps, lr=warm_start.lr, seed=seed + 1)
    return TeacherScorer(teacher, cpus=model.teacher_cpus)


def rollout_datamodule(
    rollout: RolloutSettings, engine, tokenizer, tasks, objective: str, teacher: TeacherScorer | None, seed: int
) -> RolloutDataModule:
    """The DataModule ``fit`` streams from: ``rollout``'s tasks, agent limits and concurrency on ``engine``, with the
    agent loop on ``rollout.cpus`` (beside its replicas, not on the learner's cores)."""
    return RolloutDataModule(
        engine,
        tokenizer,
        tasks,
        attempt_factory(rollout),
        objective,
        rollout.prompts_per_update,
        rollout.samples_per_prompt,
        agent_limits(rollout),
        teacher,
        seed,
        max_concurrent_attempts=rollout.max_concurrent_attempts,
        cpus=rollout.cpus,
    )


def attempt_factory(rollout: RolloutSettings):
    if rollout.environment == "simulated_tool":
        return SimulatedToolEnvironment(rollout.simulated_tool)
    return lambda task: TerminalTaskAttempt(task, rollout.reward_scheme)


def demonstrations(rollout: RolloutSettings, tasks, near_misses: bool):
    if rollout.environment == "simulated_tool":
        return gauge_demonstrations(tasks, rollout.simulated_tool, near_misses)
    return task_demonstrations(tasks, near_misses)


def agent_limits(rollout: RolloutSettings) -> AgentLimits:
    return AgentLimits(
        max_turns=rollout.max_turns,
        max_tokens_per_turn=rollout.max_tokens_per_turn,
        max_tokens_per_trajectory=rollout.max_tokens_per_trajectory,
        observation=ObservationWindow(rollout.observation_head_tokens, rollout.observation_tail_tokens),
    )


def place_learner(cpus: list[int] | None) -> None:
    if cpus is None:
        return
    if not cpus:
        raise ValueError("learner.cpus is empty; list at least one core, or null to leave placement alone")
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
