"""The shape a ``fit`` run's learner trains in, for planning its memory (:mod:`tslightning.measure.memory_plan`):
the policy's Hugging Face config (no weights read) and, per rank, its precision, LoRA, strategy, open groups and
longest pass."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from tslightning.distributed.parameter_placement import placement_for
from tslightning.loop.settings import ModelSettings, RolloutSettings
from tslightning.measure.memory_plan import LearnerShape, MemoryPlan, plan_learner_memory


def policy_config(model: ModelSettings, model_config_path: str | None = None) -> Any:
    """The policy's Hugging Face config: ``model_config_path``, else ``model.path``'s, else the tiny model's."""
    import transformers

    if model_config_path is not None:
        values = json.loads(Path(model_config_path).read_text())
        return transformers.AutoConfig.for_model(**values)
    if model.path is not None:
        return transformers.AutoConfig.from_pretrained(model.path, local_files_only=True)
    from tslightning.models.tiny_model import build_tokenizer, tiny_qwen2_config

    return tiny_qwen2_config(model.tiny, build_tokenizer())


def learner_shape(
    config: Any,
    objective: str,
    model: ModelSettings,
    rollout: RolloutSettings,
    learner,
    group_admission_cap,
    schedule: str = "thundersync",
    statistics_device: str | None = None,
    micro_batch_size: int = 1,
    optimizer_state_dtype: str = "float32",
) -> LearnerShape:
    """The :class:`LearnerShape` a ``fit`` run with these settings trains in, per rank; ``statistics_device``
    resolves ``learner.statistics_device: auto`` (``None``: the setting, ``auto`` planned as the host)."""
    context = rollout.max_context_tokens or getattr(config, "max_position_embeddings", 4096)
    strategy = "ddp" if learner.strategy == "auto" and learner.world_size > 1 else learner.strategy
    statistics_device = statistics_device or learner.statistics_device
    return LearnerShape(
        precision=model.precision,
        placement=placement_for(strategy, learner.shard_statistics),
        world_size=learner.world_size,
        objective=objective,
        schedule="thundersync" if schedule == "thundersync" else "sync",
        open_groups=_open_groups(rollout.prompts_per_update, learner, group_admission_cap),
        sequence_tokens=context,
        statistics_device="host" if statistics_device == "auto" else statistics_device,
        spread_groups=learner.shard_statistics,  # fit deals GRPO groups over the ranks then (RolloutDataModule)
        fold_queue_depth=learner.fold_queue_depth,
        micro_batch_size=micro_batch_size,
        logprob_chunk_tokens=learner.logprob_chunk_tokens,
        optimizer_state_dtype=optimizer_state_dtype,
        lora_rank=model.lora.r if model.lora is not None else None,
        lora_targets=tuple(model.lora.target_modules) if model.lora is not None else (),
    )


def _open_groups(prompts: int, learner, cap: int | None) -> int:
    """GRPO groups holding statistics at once: per rank with whole groups; over all ranks when ``fit`` spreads them
    (``learner.shard_statistics``), where the admission cap counts globally."""
    groups = prompts if learner.shard_statistics else math.ceil(prompts / learner.world_size)
    return min(cap or groups, groups)


@dataclass(frozen=True)
class PlannedMemory:
    """A run's per-rank memory plan on a device of ``available`` bytes (``None``: a CPU learner), with
    ``learner.statistics_device: auto`` resolved: the device when the plan fits there, else the host."""

    shape: LearnerShape
    plan: MemoryPlan
    available: int | None
    checkpointing: bool

    @property
    def statistics_device(self) -> str:
        return self.shape.statistics_device

    @property
    def fits(self) -> bool:
        return self.available is None or self.plan.device_bytes(self.checkpointing) <= self.available

    def problems(self) -> list[str]:
        """One line when the run does not fit its device, naming the settings to change."""
        if self.fits:
            return []
        need = self.plan.device_bytes(self.checkpointing)
        advice = "; ".join(self.plan.advice(self.available, self.shape, self.checkpointing))
        return [
            f"learner: each rank needs {need / 2**30:.1f} GiB at its peak but its device has "
            f"{self.available / 2**30:.1f} GiB (tslightning plan --config ... shows every component); change: {advice}"
        ]


def planned_memory(
    config: Any,
    objective: str,
    schedule: str,
    model: ModelSettings,
    rollout: RolloutSettings,
    learner,
    group_admission_cap,
    micro_batch_size: int,
    available: int | None,
    optimizer_state_dtype: str = "float32",
) -> PlannedMemory:
    """Plan the run; resolve ``statistics_device: auto`` against ``available`` device bytes (a CPU learner, or an
    unknown device: the host)."""
    shape_for = partial(
        learner_shape, config, objective, model, rollout, learner, group_admission_cap, schedule,
        micro_batch_size=micro_batch_size, optimizer_state_dtype=optimizer_state_dtype,
    )  # fmt: skip
    checkpointing = learner.activation_checkpointing
    if learner.statistics_device == "auto" and available is not None:
        shape = shape_for("device")
        on_device = PlannedMemory(shape, plan_learner_memory(config, shape), available, checkpointing)
        if on_device.fits:
            return on_device
    shape = shape_for("host" if learner.statistics_device == "auto" else learner.statistics_device)
    return PlannedMemory(shape, plan_learner_memory(config, shape), available, checkpointing)
