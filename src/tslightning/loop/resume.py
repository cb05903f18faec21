"""Checkpoints in `fit`: the GPU-clock checkpointer it installs, the checks on ``--resume``, and the restore that has
the replicas serve the restored θ_k before update k + 1 samples anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tslightning.callbacks import GPUClockCheckpoint
from tslightning.callbacks.checkpoint_state import STATE_FILE, restore_checkpoint
from tslightning.callbacks.gpu_clock_checkpoint import checkpointed_callbacks
from tslightning.callbacks.weight_publisher import publishable_state_dict
from tslightning.loop.settings import CheckpointSettings


def checkpointer(settings: CheckpointSettings, out: Path, seed: int, config: Mapping[str, Any]) -> GPUClockCheckpoint:
    """The run's GPU-clock checkpointer; each checkpoint's ``meta.json`` records the resolved ``config``."""
    return GPUClockCheckpoint(
        settings.dirpath or out / "checkpoints",
        settings.interval_s,
        settings.devices,
        settings.keep_last,
        seed=seed,
        config=config,
        save_last=settings.save_last,
    )


def resume_problems(resume: str | None, schedule: str) -> list[str]:
    """Why this run cannot resume from ``resume`` with ``schedule`` (empty: it can, or there is no resume)."""
    if resume is None or schedule in ("sync", "thundersync"):
        return []
    return [
        f"resume: schedule {schedule!r} cannot resume exactly (its next batch was sampled, at least in part, before "
        "the checkpointed θ_k, and in-flight rollouts are not checkpointed); resume with schedule sync or thundersync"
    ]


def missing_checkpoint(resume: str | None) -> list[str]:
    """``resume`` as a missing path, unless it is a checkpoint directory (what a checkpoint holds is checked when it
    is restored)."""
    if resume is None or (Path(resume) / STATE_FILE).is_file():
        return []
    parent = Path(resume).parent
    found = sorted(p.name for p in parent.glob("update-*") if (p / STATE_FILE).is_file()) if parent.is_dir() else []
    where = f" (checkpoints in {parent}: {', '.join(found)})" if found else ""
    return [f"resume: {resume} holds no {STATE_FILE}; give an update-<k> checkpoint directory{where}"]


def resume_from(path: str, fabric, module, optimizer, engine) -> int:
    """Restore a checkpoint into the set-up module, optimizer and callbacks; returns the next update index.

    The replicas still serve θ_0 from startup: publishing the restored θ_k at version k before update k samples
    anything keeps the resumed run zero-stale (and ``BatchPlan`` versions matching the module's).
    """
    point = restore_checkpoint(path, module, [optimizer], checkpointed_callbacks(fabric), fabric.global_rank)
    if fabric.global_rank == 0 or fabric.world_size > 1:  # several ranks: each has its own engine
        engine.publish(publishable_state_dict(module.policy), point.policy_version)
    fabric.barrier()
    return point.next_update
