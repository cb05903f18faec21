"""Learner ranks for `tslightning fit`: typed settings validated at once, and the Fabric strategy each one builds."""

from __future__ import annotations

from datetime import timedelta

import pytest
from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy

from tslightning.distributed.learner_strategy import LearnerSettings, learner_strategy
from tslightning.loop.fit import fit


def test_one_rank_needs_no_strategy_and_several_default_to_ddp_over_gloo_on_cpu():
    assert learner_strategy(LearnerSettings(), "cpu") == "auto"
    strategy = learner_strategy(LearnerSettings(devices=2, timeout_s=42), "cpu")
    assert type(strategy) is DDPStrategy
    assert strategy._process_group_backend == "gloo" and strategy._timeout == timedelta(seconds=42)
    assert learner_strategy(LearnerSettings(num_nodes=2, strategy="ddp"), "cuda")._process_group_backend is None


def test_fsdp_is_fsdp2_through_fabric_model_parallel_over_every_rank():
    from tslightning.distributed.fsdp_gradients import shard_policy

    strategy = learner_strategy(LearnerSettings(devices=2, num_nodes=2, strategy="fsdp", timeout_s=5), "cpu")
    assert isinstance(strategy, ModelParallelStrategy) and strategy._timeout == timedelta(seconds=5)
    assert strategy._parallelize_fn is shard_policy and strategy._process_group_backend == "gloo"
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (4, 1)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_on_cpu_uses_the_gloo_subclass(stage):
    pytest.importorskip("deepspeed")
    from tslightning.distributed.deepspeed_cpu import CPUDeepSpeedStrategy

    strategy = learner_strategy(LearnerSettings(devices=2, strategy=f"deepspeed_stage_{stage}"), "cpu")
    assert isinstance(strategy, CPUDeepSpeedStrategy) and strategy._process_group_backend == "gloo"
    assert strategy.config["zero_optimization"]["stage"] == stage
    on_gpu = learner_strategy(LearnerSettings(devices=2, strategy=f"deepspeed_stage_{stage}"), "cuda")
    assert type(on_gpu) is DeepSpeedStrategy


def test_every_problem_is_reported_at_once():
    problems = LearnerSettings(devices=0, strategy="fsdp", timeout_s=0).problems("fully_async")
    assert len(problems) == 2
    assert "learner.devices" in problems[0] and "learner.timeout_s" in problems[1]
    assert LearnerSettings(devices=2).problems("fully_async") == [
        "schedule fully_async runs on one learner rank; set learner.devices=1 and num_nodes=1"
    ]
    for strategy in ("deepspeed_stage_2", "deepspeed_stage_3", "fsdp"):
        assert LearnerSettings(devices=2, num_nodes=3, strategy=strategy).problems("sync") == []


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3", "fsdp"])
def test_fit_takes_checkpoints_and_resume_of_partitioned_state(strategy):
    """Partitioned strategies write sharded checkpoints now (tests/distributed/test_sharded_resume.py)."""
    from tslightning.loop.settings import CheckpointSettings, ModelSettings, RolloutSettings, setting_problems

    learner = LearnerSettings(devices=2, strategy=strategy)
    for resume in (None, "runs/x/checkpoints/update-3"):
        problems = setting_problems(
            "grpo",
            "thundersync",
            "recompute",
            ModelSettings(),
            RolloutSettings(),
            learner,
            CheckpointSettings(),
            resume,
        )
        assert problems == []


@pytest.mark.parametrize("strategy", ["deepspeed_stage_3", "fsdp"])
def test_fit_refuses_boundary_context_backward_with_sharded_parameters(tmp_path, strategy):
    from tslightning.loop.fit import AlgorithmSettings, CheckpointSettings

    with pytest.raises(ValueError, match="serves sources in lock-step, one policy pass each"):
        fit(
            out_dir=str(tmp_path / "run"),
            learner=LearnerSettings(devices=2, strategy=strategy),
            checkpoint=CheckpointSettings(enabled=False),
            algorithm=AlgorithmSettings(context_backward="boundary"),
            progress=False,
        )
    assert not (tmp_path / "run").exists()
