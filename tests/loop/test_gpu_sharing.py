"""A learner rank and its vLLM engine on one GPU: vLLM in a process of its own on the rank's GPU, memory planned."""

from __future__ import annotations

import pytest
import torch

import tslightning.loop.startup as startup
import tslightning.rollout.vllm_engine.engine as vllm_engine
from tslightning.distributed.learner_strategy import LearnerSettings
from tslightning.distributed.rank_placement import RankPlacement
from tslightning.loop.gpu_sharing import CONTEXT_MARGIN_BYTES, gpu_sharing_problems, teacher_bytes
from tslightning.loop.learner_shape import planned_memory, policy_config
from tslightning.loop.settings import ModelSettings, RolloutSettings, VLLMSettings

GIB = 2**30


def _rollout(utilization: float, gpus=None) -> RolloutSettings:
    return RolloutSettings(engine="vllm", vllm=VLLMSettings(gpu_memory_utilization=utilization, gpus=gpus))


def _sharing(objective: str, rollout: RolloutSettings, device_bytes: int | None) -> list[str]:
    """The problems of the tiny model's default run beside vLLM, its learner planned as preflight plans it."""
    model, learner = ModelSettings(), LearnerSettings()
    planned = planned_memory(policy_config(model), objective, "thundersync", model, rollout, learner, None, 1, None)
    plan = planned.plan.device_bytes(planned.checkpointing)
    return gpu_sharing_problems(objective, model, rollout, plan, device_bytes)


def test_vllm_taking_too_much_of_the_learners_gpu_is_refused_naming_what_fits():
    (problem,) = _sharing("grpo", _rollout(0.9), 10 * GIB)
    assert problem.startswith("rollout.vllm.gpu_memory_utilization 0.9 leaves the learner 1.0 GiB of the 10.0 GiB")
    assert "set rollout.vllm.gpu_memory_utilization to at most 0.7" in problem
    assert _sharing("grpo", _rollout(0.7), 10 * GIB) == []
    assert _sharing("grpo", _rollout(0.9, [1]), GIB) == []
    assert _sharing("grpo", _rollout(0.9), None) == []  # CPU
    (tiny_gpu,) = _sharing("grpo", _rollout(0.1), 2 * GIB)
    assert tiny_gpu.endswith("give vLLM GPUs of its own (rollout.vllm.gpus)")


def test_the_opd_teacher_on_the_learners_gpu_is_counted():
    teacher = teacher_bytes(ModelSettings(precision="bf16-mixed"))
    assert 0 < teacher < GIB
    device = CONTEXT_MARGIN_BYTES + 10 * 2**20 + teacher  # room for the learner's tiny plan, then the teacher
    grpo = _sharing("grpo", _rollout(0.0), device * 2)
    (opd,) = _sharing("opd", _rollout(0.6), device * 2)
    assert grpo == [] and "the teacher" in opd


@pytest.fixture
def started(monkeypatch):
    """The arguments each vLLM engine is created with (none is started)."""
    created = []
    monkeypatch.setattr(vllm_engine, "VLLMRolloutEngine", lambda *args, **kwargs: created.append(kwargs))
    return created


def test_on_a_gpu_vllm_runs_in_its_own_process_on_the_learners_gpu(started, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    startup._start_vllm(RolloutSettings(), "policy", "bfloat16", None, RankPlacement(0, 1), 1, 1024)
    rollout = RolloutSettings(vllm=VLLMSettings(gpus=[6, 7]))
    startup._start_vllm(rollout, "policy", "bfloat16", None, RankPlacement(1, 2), 2, 1024)
    (alone, placed) = started
    assert alone["in_process"] is False and alone["gpus"] == ["5"]  # the learner's GPU, never the node's first
    assert placed["in_process"] is False and placed["gpus"] == [7]


def test_on_a_cpu_one_rank_keeps_vllm_in_process(started, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    startup._start_vllm(RolloutSettings(), "policy", "float32", None, RankPlacement(0, 1), 1, 1024)
    assert started[0]["in_process"] is True and started[0]["gpus"] is None
