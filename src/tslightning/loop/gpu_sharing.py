"""One GPU shared by a learner rank and its ``vllm`` rollout engine (``rollout.vllm.gpus`` unset on a CUDA machine).

vLLM then runs in a process of its own on the learner's GPU (never inside the learner: it would share the learner's
CUDA context and stream, so rollout and learning would serialize, and it would size its memory before the policy
moved there). The two processes time-share the GPU (with NVIDIA MPS their kernels run concurrently), and their
memory must fit together: vLLM takes ``rollout.vllm.gpu_memory_utilization`` of the GPU, and the learner needs what
its memory plan says (:func:`~tslightning.measure.memory_plan.plan_learner_memory`; ``tslightning plan`` prints it)
plus, for OPD, the in-process teacher's weights and a margin for the CUDA context and allocator.
:func:`gpu_sharing_problems` refuses a run that cannot fit before anything is written.
"""

from __future__ import annotations

import os

import torch

from tslightning.learner.precision import serving_dtype
from tslightning.loop.learner_shape import policy_config
from tslightning.loop.settings import ModelSettings, RolloutSettings

CONTEXT_MARGIN_BYTES = 2 * 2**30
"""The learner process's CUDA context, cuBLAS/NCCL workspaces and allocator slack beside its planned tensors."""


def shares_learner_gpu(rollout: RolloutSettings) -> bool:
    """Whether this rank's ``vllm`` engine runs on the learner's own GPU (no ``rollout.vllm.gpus``, CUDA present)."""
    return rollout.engine == "vllm" and rollout.vllm.gpus is None and torch.cuda.is_available()


def learner_gpu() -> str:
    """The learner's current CUDA device as its engine's process must name it in ``CUDA_VISIBLE_DEVICES``."""
    index = torch.cuda.current_device()
    visible = [entry for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    return visible[index].strip() if index < len(visible) else str(index)


def gpu_sharing_problems(
    objective: str, model: ModelSettings, rollout: RolloutSettings, plan: int, device_bytes: int | None
) -> list[str]:
    """A learner rank whose planned peak (``plan`` bytes, :func:`~tslightning.loop.learner_shape.planned_memory`)
    cannot fit beside its vLLM engine on one GPU of ``device_bytes`` (``None``: no GPU run)."""
    if device_bytes is None or rollout.engine != "vllm" or rollout.vllm.gpus is not None:
        return []
    teacher = teacher_bytes(model) if objective == "opd" and rollout.teacher_url is None else 0
    need = plan + teacher + CONTEXT_MARGIN_BYTES
    utilization = rollout.vllm.gpu_memory_utilization
    left = (1 - utilization) * device_bytes
    if need <= left:
        return []
    most = _floor_hundredths((device_bytes - need) / device_bytes)
    fix = (
        f"set rollout.vllm.gpu_memory_utilization to at most {most:.2f}, or give vLLM GPUs of its own"
        if most >= 0.05
        else "give vLLM GPUs of its own"
    )
    return [
        f"rollout.vllm.gpu_memory_utilization {utilization} leaves the learner {left / 2**30:.1f} GiB of the "
        f"{device_bytes / 2**30:.1f} GiB GPU it shares with vLLM (rollout.vllm.gpus: null), but the learner needs "
        f"{need / 2**30:.1f} GiB (its plan {plan / 2**30:.1f} GiB"
        + (f", the teacher {teacher / 2**30:.1f} GiB" if teacher else "")
        + f", {CONTEXT_MARGIN_BYTES / 2**30:.0f} GiB for its CUDA context; tslightning plan): {fix} "
        "(rollout.vllm.gpus)"
    ]


def teacher_bytes(model: ModelSettings) -> int:
    """The in-process OPD teacher's weights on the learner's device, in the serving dtype."""
    import transformers

    if model.teacher_path is not None:
        config = transformers.AutoConfig.from_pretrained(model.teacher_path, local_files_only=True)
    else:
        config = policy_config(ModelSettings(tiny=model.tiny))
    with torch.device("meta"):
        numel = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    return numel * torch.empty((), dtype=getattr(torch, serving_dtype(model.precision))).element_size()


def _floor_hundredths(value: float) -> float:
    """``value`` rounded toward zero to two decimals."""
    return int(value * 100) / 100
