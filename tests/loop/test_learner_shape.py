"""The learner shape ``plan`` and preflight size: open groups per rank, or over all ranks when groups are spread."""

from __future__ import annotations

from tslightning.distributed.learner_strategy import LearnerSettings
from tslightning.loop.learner_shape import learner_shape
from tslightning.loop.settings import ModelSettings, RolloutSettings
from tslightning.models.tiny_model import TinyModelConfig, build_tokenizer, tiny_qwen2_config


def _shape(learner: LearnerSettings, cap: int | None):
    config = tiny_qwen2_config(TinyModelConfig(), build_tokenizer())
    return learner_shape(config, "grpo", ModelSettings(), RolloutSettings(prompts_per_update=8), learner, cap)


def test_whole_groups_count_per_rank_and_spread_groups_over_all_ranks():
    whole = _shape(LearnerSettings(devices=4, strategy="fsdp"), None)
    assert whole.open_groups == 2 and not whole.spread_groups  # 8 prompts over 4 ranks
    assert _shape(LearnerSettings(devices=4, strategy="fsdp"), 1).open_groups == 1
    spread = _shape(LearnerSettings(devices=4, strategy="fsdp", shard_statistics=True), None)
    assert spread.open_groups == 8 and spread.spread_groups  # every group on every rank
    assert spread.placement.shards_statistics
    capped = _shape(LearnerSettings(devices=4, strategy="fsdp", shard_statistics=True), 1)
    assert capped.open_groups == 1  # the cap counts groups open anywhere
