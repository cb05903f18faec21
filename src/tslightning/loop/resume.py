"""Checkpoints in `fit`: the GPU-clock checkpointer it installs, the checks on ``--resume``, and the restore that has
the replicas serve the restored θ_k before update k + 1 samples anything.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tslightning.callbacks import GPUClockCheckpoint
from tslightning.callbacks.checkpoint_layout import REPLICATED, layout_mismatch, missing_parts
from tslightning.callbacks.checkpoint_state import META_FILE, STATE_FILE, CheckpointError, restore_checkpoint
from tslightning.callbacks.gpu_clock_checkpoint import checkpointed_callbacks
from tslightning.callbacks.weight_publisher import hand_over_weights, publication_weights, publish_to_shared_servers
from tslightning.distributed.learner_strategy import LearnerSettings
from tslightning.distributed.parameter_placement import placement_of
from tslightning.loop.settings import CheckpointSettings, InvalidSettingsError


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
    if resume is None or (Path(resume) / STATE_FILE).exists():
        return []
    parent = Path(resume).parent
    found = sorted(p.name for p in parent.glob("update-*") if (p / STATE_FILE).exists()) if parent.is_dir() else []
    where = f" (checkpoints in {parent}: {', '.join(found)})" if found else ""
    return [f"resume: {resume} holds no {STATE_FILE}; give an update-<k> checkpoint directory{where}"]


LAYOUTS = {"auto": REPLICATED, "ddp": REPLICATED}
"""The checkpoint layout each ``learner.strategy`` writes (the sharded ones write their own name)."""


def unreadable_checkpoint(resume: str | None, learner: LearnerSettings | None = None) -> list[str]:
    """Cheap checks of a ``resume`` checkpoint before anything is built or written: a replicated ``state.pt`` is a
    whole torch zip archive (a truncated one has no central directory), a sharded one holds its strategy's index
    files; ``meta.json`` parses; and the checkpoint's layout and world size are ``learner``'s. One line per problem,
    naming the file or the setting; the full load at restore checks the rest
    (:class:`~tslightning.callbacks.CheckpointError`)."""
    if resume is None or not (Path(resume) / STATE_FILE).exists():
        return []
    path = Path(resume)
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as error:
        reason = " ".join(f"{type(error).__name__}: {error}".split())
        meta_problems = [f"resume: cannot read {path / META_FILE} ({reason}); resume from another update-<k> directory"]
        return _state_problems(path, REPLICATED) + meta_problems
    meta = meta if isinstance(meta, dict) else {}
    problems = _state_problems(path, meta.get("layout", REPLICATED))
    return problems + (_layout_problems(path, meta, learner) if learner is not None else [])


def _state_problems(path: Path, layout: str) -> list[str]:
    """``state.pt`` of checkpoint ``path`` as ``layout`` would leave it, or one line naming what is damaged."""
    if layout == REPLICATED and not zipfile.is_zipfile(path / STATE_FILE):
        return [
            f"resume: {path / STATE_FILE} is not a torch checkpoint archive (truncated or corrupt); resume from "
            f"another update-<k> directory in {path.parent}"
        ]
    if layout != REPLICATED and (missing := missing_parts(path / STATE_FILE, layout)):
        return [
            f"resume: {path / STATE_FILE} lacks {', '.join(missing)} of its {layout} shards (damaged); resume from "
            f"another update-<k> directory in {path.parent}"
        ]
    return []


def _layout_problems(path: Path, meta: dict, learner: LearnerSettings) -> list[str]:
    """A checkpoint of another layout, or a sharded one of another world size, named by the settings to change."""
    mismatch = layout_mismatch(meta, LAYOUTS.get(learner.strategy, learner.strategy), learner.world_size)
    if mismatch is None:
        return []
    written = meta.get("layout", REPLICATED)
    fix = "ddp" if written == REPLICATED else f"{written} on {meta.get('world_size')} rank(s)"
    return [
        f"resume: {path} cannot continue as learner.strategy {learner.strategy!r} on {learner.world_size} rank(s) "
        f"(learner.devices × learner.num_nodes): {mismatch}; resume with learner.strategy {fix}"
    ]


def resume_from(path: str, fabric, module, optimizer, engine) -> int:
    """Restore a checkpoint into the set-up module, optimizer and callbacks; returns the next update index.

    The replicas still serve θ_0 from startup: publishing the restored θ_k at version k before update k samples
    anything keeps the resumed run zero-stale (and ``BatchPlan`` versions matching the module's). ``engine`` is
    ``None`` only in a replay (``fit --replay_batches``), which starts no engine: the restored θ_k is served to no one.
    """
    try:
        callbacks = checkpointed_callbacks(fabric)
        point = restore_checkpoint(path, module, [optimizer], callbacks, fabric.global_rank, fabric)
    except CheckpointError as error:  # the resume setting names a damaged checkpoint: one line, as every setting
        raise InvalidSettingsError([str(error)]) from error
    if engine is not None:  # the same on every rank: a replay is the whole run's setting
        shared = fabric.world_size > 1 and bool(getattr(engine, "shared_servers", False))  # rank 0 publishes for all
        # LoRA on vLLM servers: the adapter alone; else streamed (every rank joins a sharded policy's gathers)
        placement = placement_of(module, fabric.strategy)  # not bound before its first batch
        weights = publication_weights(module.policy, engine, placement, leads=shared and fabric.global_rank == 0)
        if shared:
            publish_to_shared_servers(engine, weights, point.policy_version, fabric.global_rank)
        elif fabric.global_rank == 0 or fabric.world_size > 1:  # several ranks: each has its own engine
            hand_over_weights(engine, weights, point.policy_version)
    fabric.barrier()
    return point.next_update
