"""``tslightning plan``'s printed report: per rank, and saying when the statistics are sharded."""

from __future__ import annotations

from tslightning.commands.plan import plan_report
from tslightning.measure.memory_plan import LearnerShape, plan_learner_memory
from tslightning.models.tiny_model import TinyModelConfig, build_tokenizer, tiny_qwen2_config


def test_the_report_names_the_sharded_statistics_and_what_to_change():
    config = tiny_qwen2_config(TinyModelConfig(), build_tokenizer())
    shape = LearnerShape(strategy="fsdp", world_size=2, open_groups=1, statistics_device="device")
    whole = plan_report(plan_learner_memory(config, shape, activations=False), shape, 0.001, False)
    assert "1 open group(s) per rank" in whole and "sharded" not in whole.splitlines()[0]
    assert "change: learner.shard_statistics: true" in whole
    sharded_shape = LearnerShape(
        strategy="fsdp", world_size=2, open_groups=1, statistics_device="device", shard_statistics=True
    )
    sharded = plan_report(plan_learner_memory(config, sharded_shape, activations=False), sharded_shape, 0.001, False)
    assert "statistics sharded over 2 ranks" in sharded.splitlines()[0]
    assert "statistics, 1/2 shard (all ranks' groups)" in sharded and "shard_statistics: true" not in sharded
