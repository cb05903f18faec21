"""``tslightning plan``'s printed report: per rank, and saying when the statistics are sharded."""

from __future__ import annotations

from tslightning.distributed.parameter_placement import placement_for
from tslightning.measure.memory_plan import LearnerShape, plan_learner_memory, plan_report
from tslightning.models.tiny_model import TinyModelConfig, build_tokenizer, tiny_qwen2_config


def test_the_report_names_the_sharded_statistics_and_what_to_change():
    config = tiny_qwen2_config(TinyModelConfig(), build_tokenizer())
    shape = LearnerShape(placement=placement_for("fsdp"), world_size=2, open_groups=1, statistics_device="device")
    whole = plan_report(plan_learner_memory(config, shape, activations=False), shape, 0.001, False)
    assert "1 open group(s) per rank" in whole and "sharded" not in whole.splitlines()[0]
    assert "change: learner.shard_statistics: true" in whole
    sharded_shape = LearnerShape(
        placement=placement_for("fsdp", shard_statistics=True), world_size=2, open_groups=1, statistics_device="device"
    )
    sharded = plan_report(plan_learner_memory(config, sharded_shape, activations=False), sharded_shape, 0.001, False)
    assert "statistics on the device sharded over 2 ranks" in sharded.splitlines()[0]
    assert "statistics, 1/2 shard (all ranks' groups)" in sharded and "shard_statistics: true" not in sharded


def test_the_report_counts_spread_groups_over_all_ranks():
    config = tiny_qwen2_config(TinyModelConfig(), build_tokenizer())
    shape = LearnerShape(
        placement=placement_for("fsdp", shard_statistics=True), world_size=2, open_groups=1, statistics_device="device"
    )
    spread_shape = LearnerShape(**{**shape.__dict__, "spread_groups": True})
    spread_plan = plan_learner_memory(config, spread_shape, activations=False)
    spread = plan_report(spread_plan, spread_shape, None, False)
    assert "1 open group(s) over all ranks" in spread and "1/2 shard (groups open anywhere)" in spread
    assert spread_plan.statistics < plan_learner_memory(config, shape, activations=False).statistics  # 3 vs 5 shards
