"""One-GPU check of the learner path: a bf16-mixed ``fit`` of 3 updates with the vLLM engine on CUDA and a one-rank
NCCL process group, the memory plan beside torch's measured peak, one PASS/FAIL line per check (exit 1 on a FAIL).

Run on a GPU machine after ``pip install -e '.[vllm]'`` (about 5 minutes; nothing is downloaded: the tiny model is
built offline): ``bash scripts/check_gpu.sh``. ``--accelerator cpu --engine hf`` runs the same checks on a CPU
(gloo, the HF engine), which the test suite does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import lightning as L
import torch.distributed as dist

from tslightning.distributed.learner_strategy import LearnerSettings
from tslightning.learner.precision import serving_dtype
from tslightning.loop import fit
from tslightning.loop.learner_shape import learner_shape, policy_config
from tslightning.loop.settings import (
    CheckpointSettings,
    ModelSettings,
    RolloutSettings,
    VLLMSettings,
    WarmStartSettings,
)
from tslightning.measure.memory_plan import plan_learner_memory


class ProcessGroupProbe(L.Callback):
    """Records the learner's process group (backend, world size) and the engine's served dtype at train start."""

    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.seen = {
            "initialized": dist.is_initialized(),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "parameter_dtype": str(next(pl_module.policy.parameters()).dtype),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--engine", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--out", default="runs/check_gpu")
    parser.add_argument("--updates", type=int, default=3)
    args = parser.parse_args()
    gpu = args.accelerator == "cuda"
    probe = ProcessGroupProbe()
    model = ModelSettings(precision="bf16-mixed")
    rollout = RolloutSettings(
        engine=args.engine,
        task_names=["count-lines", "dedupe-lines"],
        prompts_per_update=2,
        samples_per_prompt=4,
        max_turns=2,
        vllm=VLLMSettings(gpus=[0] if gpu else None, gpu_memory_utilization=0.3),
    )
    learner = LearnerSettings(devices=1, strategy="ddp", process_group_backend="nccl" if gpu else "gloo")
    result = fit(
        updates=args.updates,
        out_dir=args.out,
        overwrite=True,
        model=model,
        rollout=rollout,
        warm_start=WarmStartSettings(steps=300),
        accelerator=args.accelerator,
        learner=learner,
        available_flops=None if gpu else 1e11,
        checkpoint=CheckpointSettings(enabled=False),
        callbacks=[probe],
        progress=False,
    )
    config = policy_config(model)
    shape = learner_shape(config, "grpo", model, rollout, learner, None)
    planned = plan_learner_memory(config, shape).device_bytes(checkpointing=False) / 2**20
    checks = [
        ("fit ran every update", len(result.mean_rewards) == args.updates, f"{len(result.mean_rewards)} updates"),
        (
            "one process group of Fabric's size",
            probe.seen.get("initialized") and probe.seen.get("world_size") == 1,
            json.dumps(probe.seen),
        ),
        (
            f"the backend is {learner.process_group_backend}",
            probe.seen.get("backend") == learner.process_group_backend,
            str(probe.seen.get("backend")),
        ),
        (
            "float32 master weights under bf16-mixed",
            probe.seen.get("parameter_dtype") == "torch.float32",
            probe.seen.get("parameter_dtype", ""),
        ),
        ("the engine serves bfloat16", serving_dtype(model.precision) == "bfloat16", serving_dtype(model.precision)),
        (
            "the measured peak stays within the plan",
            0 < result.peak_learner_memory_mb <= planned or not gpu,
            f"measured peak {result.peak_learner_memory_mb:.0f} MiB, planned {planned:.0f} MiB"
            + ("" if gpu else " (CPU: the peak is the process's resident set, not compared)"),
        ),
    ]
    for name, passed, detail in checks:
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {detail}")
    report = [{"check": name, "pass": bool(passed), "detail": detail} for name, passed, detail in checks]
    (Path(args.out) / "check_gpu.json").write_text(json.dumps(report, indent=2))
    return 0 if all(passed for _, passed, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
