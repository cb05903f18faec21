"""``tslightning plan``: each learner rank's memory for a ``fit`` config, before any GPU is asked for it.

The model comes from ``model.path``'s ``config.json`` (no weights are read), ``--model_config`` (a config.json of
any Hugging Face causal LM, e.g. one copied from a model card), or the embedded tiny model; the learner from the
config's precision, LoRA, strategy, ranks, admission cap, statistics placement and context limit
(:mod:`tslightning.measure.memory_plan`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tslightning.loop.settings import ModelSettings, RolloutSettings
from tslightning.measure.memory_plan import GIB, LearnerShape, MemoryPlan


def model_config(model: ModelSettings, model_config_path: str | None = None) -> Any:
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
    config: Any, objective: str, model: ModelSettings, rollout: RolloutSettings, learner, group_admission_cap
) -> LearnerShape:
    """The :class:`LearnerShape` a ``fit`` run with these settings trains in, per rank."""
    groups_per_rank = math.ceil(rollout.prompts_per_update / learner.world_size)
    context = rollout.max_context_tokens or getattr(config, "max_position_embeddings", 4096)
    return LearnerShape(
        precision=model.precision,
        strategy="ddp" if learner.strategy == "auto" and learner.world_size > 1 else learner.strategy,
        world_size=learner.world_size,
        objective=objective,
        open_groups=min(group_admission_cap or groups_per_rank, groups_per_rank),
        sequence_tokens=context,
        statistics_device=learner.statistics_device,
        lora_rank=model.lora.r if model.lora is not None else None,
        lora_targets=tuple(model.lora.target_modules) if model.lora is not None else (),
    )


def plan_report(plan: MemoryPlan, shape: LearnerShape, gpu_memory_gb: float | None, checkpointing: bool) -> str:
    """The printed plan: the table, and whether it fits ``gpu_memory_gb`` with the settings to change if not."""
    lines = [
        f"per learner rank: {shape.precision}, strategy {shape.strategy} x {shape.world_size}, {shape.objective}, "
        f"{shape.open_groups} open group(s), {shape.sequence_tokens}-token passes"
        + (f", LoRA r={shape.lora_rank}" if shape.lora_rank else ", full fine-tuning"),
        plan.table(),
    ]
    if gpu_memory_gb is not None:
        available = int(gpu_memory_gb * GIB)
        need = plan.device_bytes(checkpointing)
        fits = "fits" if need <= available else "does NOT fit"
        lines.append(f"{need / GIB:.2f} GiB with the run's settings {fits} in {gpu_memory_gb:g} GiB of GPU memory")
        if need > available:
            lines += ["change: " + change for change in plan.advice(available, shape)]
    return "\n".join(lines)
