"""Checkpoints in `fit`: the GPU-clock checkpointer it installs, the checks on ``--resume``, and the restore that has
the replicas serve the restored θ_k before update k + 1 samples anything.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from tslightning.callbacks import GPUClockCheckpoint
from tslightning.callbacks.checkpoint_state import META_FILE, STATE_FILE, CheckpointError, restore_checkpoint
from tslightning.callbacks.gpu_clock_checkpoint import checkpointed_callbacks
from tslightning.callbacks.weight_publisher import publishable_state_dict
from tslightning.loop.settings import CheckpointSettings


def checkpointer(settings: CheckpointSettings, out: Path, seed: int) -> GPUClockCheckpoint:
    return GPUClockCheckpoint(
        settings.dirpath or out / "checkpoints",
        settings.interval_s,
        settings.devices,
        settings.keep_last,
        seed=seed,
        config=out / "config.json",
        save_last=settings.save_last,
    )


def check_resume(resume: str | None, schedule: str) -> None:
    if resume is None:
        return
    if schedule not in ("sync", "thundersync"):
        raise ValueError(
            f"resume: schedule {schedule!r} cannot resume exactly (its next batch was sampled, at least in part, "
            "before the checkpointed θ_k, and in-flight rollouts are not checkpointed); resume with schedule sync "
            "or thundersync"
        )
    if not (Path(resume) / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume: {resume} holds no {STATE_FILE}; give an update-<k> checkpoint directory")
    _check_readable(Path(resume))


def _check_readable(path: Path) -> None:
    """Cheap checks before anything is built or written: ``state.pt`` is a whole torch zip archive (a truncated one
    has no central directory) and ``meta.json`` parses. (The full load, at restore, checks the rest.)"""
    state = path / STATE_FILE
    if not zipfile.is_zipfile(state):
        raise CheckpointError(
            f"resume: {state} is not a torch checkpoint archive (truncated or corrupt); resume from another "
            f"update-<k> directory in {path.parent}"
        )
    try:
        json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as error:
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        raise CheckpointError(
            f"resume: cannot read {path / META_FILE} ({reason}); resume from another update-<k>"
        ) from None


def resume_from(path: str, fabric, module, optimizer, engine) -> int:
    """Restore a checkpoint into the set-up module, optimizer and callbacks; returns the next update index.

    The replicas still serve θ_0 from startup: publishing the restored θ_k at version k before update k samples
    anything keeps the resumed run zero-stale (and ``BatchPlan`` versions matching the module's).
    """
    point = restore_checkpoint(path, module, [optimizer], checkpointed_callbacks(fabric), fabric.global_rank, fabric)
    if fabric.global_rank == 0 or fabric.world_size > 1:  # several ranks: each has its own engine
        engine.publish(publishable_state_dict(module.policy), point.policy_version)
    fabric.barrier()
    return point.next_update
