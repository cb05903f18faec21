"""The shape a ``fit`` run's learner trains in, for planning its memory (:mod:`tslightning.measure.memory_plan`):
the policy's Hugging Face config (no weights read) and, per rank, its precision, LoRA, strategy, open groups and
longest pass."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from tslightning.loop.settings import ModelSettings, RolloutSettings
from tslightning.measure.memory_plan import LearnerShape


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
    config: Any, objective: str, model: ModelSettings, rollout: RolloutSettings, learner, group_admission_cap
) -> LearnerShape:
    """The :class:`LearnerShape` a ``fit`` run with these settings trains in, per rank."""
    context = rollout.max_context_tokens or getattr(config, "max_position_embeddings", 4096)
    return LearnerShape(
        precision=model.precision,
        strategy="ddp" if learner.strategy == "auto" and learner.world_size > 1 else learner.strategy,
        world_size=learner.world_size,
        objective=objective,
        open_groups=_open_groups(rollout.prompts_per_update, learner, group_admission_cap),
        sequence_tokens=context,
        statistics_device=learner.statistics_device,
        shard_statistics=learner.shard_statistics,
        spread_groups=learner.shard_statistics,  # fit deals GRPO groups over the ranks then (RolloutDataModule)
        fold_queue_depth=learner.fold_queue_depth,
        logprob_chunk_tokens=learner.logprob_chunk_tokens,
        lora_rank=model.lora.r if model.lora is not None else None,
        lora_targets=tuple(model.lora.target_modules) if model.lora is not None else (),
    )


def _open_groups(prompts: int, learner, cap: int | None) -> int:
    """GRPO groups holding statistics at once: per rank with whole groups; over all ranks when ``fit`` spreads them
    (``learner.shard_statistics``), where the admission cap counts globally."""
    groups = prompts if learner.shard_statistics else math.ceil(prompts / learner.world_size)
    return min(cap or groups, groups)
