"""Checkpoints on a GPU-clock schedule, written only at optimizer boundaries (SPEC §4).

GPU-clock is training wall clock × learner devices: with ``interval_s=3600`` (one GPU-hour) a run on 8 devices
checkpoints every 7.5 minutes of wall clock, one on a single device every hour. A checkpoint becomes *due* when the
GPU-clock since the last one reaches the interval (or :meth:`GPUClockCheckpoint.request` is called); it is *written*
at the next :class:`~tslightning.core.sources.BatchClosed` — after the update's step and the publication of θ_{k+1} —
never in the middle of an update, so it holds no half-folded statistics and a resumed run restarts at a clean update
boundary. What one checkpoint holds and how it is written atomically is :mod:`tslightning.callbacks.checkpoint_state`.

The callback touches only what both a ``Trainer`` and a ``Fabric`` expose (``.strategy``, ``.global_rank``,
``.world_size``), like Lightning's ``SpikeDetection``, plus the list of callbacks whose state it saves.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Checkpoint

from tslightning.callbacks.checkpoint_state import (
    FORMAT_VERSION,
    META_FILE,
    STATE_FILE,
    checkpoint_name,
    install_directory,
    policy_hash,
    prune,
    rng_file,
    rng_states,
    save_file,
    write_meta,
)
from tslightning.core.sources import BatchClosed


class GPUClockCheckpoint(Checkpoint):
    """Writes ``dirpath/update-<k>`` every ``interval_s`` of GPU-clock, at the next optimizer boundary.

    Order it after every other callback (a Trainer does so for any ``Checkpoint``), so the callback states it saves
    already include update k. The decision to write is made on global rank 0 — its clock and :meth:`request` — and
    broadcast, so every rank checkpoints the same update. Rank 0 writes the shared files; each rank writes its own RNG
    state. ``meta.json`` records ``seed``, ``update``, ``next_update``, ``policy_version``, ``policy_hash``,
    ``published_at`` (Unix time when the replicas had acknowledged that version), ``publication_s``,
    ``trajectories_seen`` and ``scored_tokens_seen`` (cumulative over all ranks and all updates, across resumes),
    ``gpu_clock_s``, ``devices``, ``written_at`` and the resolved run ``config``.

    Args:
        dirpath: Directory of the ``update-<k>`` checkpoints (created when missing).
        interval_s: GPU-clock seconds between checkpoints (SPEC §4: one hour × number of GPUs, i.e. 3600).
        devices: Learner devices the wall clock is multiplied by; ``None`` uses the world size.
        keep_last: How many newest checkpoints to keep; ``None`` keeps all.
        clock: Monotonic seconds (patch it in tests).
        seed: The run seed recorded in ``meta.json`` (``None``: the config's ``seed``, if any).
        config: The resolved run config recorded in ``meta.json``: a mapping, or the path of a JSON file read when each
            checkpoint is written (the fit loop's ``<out_dir>/config.json``).
        save_last: Also write a checkpoint when training ends, unless the last update already has one.
    """

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        interval_s: float = 3600.0,
        devices: int | None = None,
        keep_last: int | None = 3,
        clock: Callable[[], float] = time.monotonic,
        seed: int | None = None,
        config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
        save_last: bool = True,
    ) -> None:
        problems = []
        if not interval_s > 0:
            problems.append(f"interval_s must be > 0 GPU-clock seconds (SPEC §4: 3600); got {interval_s}")
        if devices is not None and (not isinstance(devices, int) or devices < 1):
            problems.append(f"devices must be an int >= 1 or None (the world size); got {devices!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            problems.append(f"keep_last must be an int >= 1 or None (keep all); got {keep_last!r}")
        if problems:
            raise ValueError("GPUClockCheckpoint: " + "; ".join(problems))
        self.dirpath = Path(dirpath)
        self.interval_s = float(interval_s)
        self.devices = devices
        self.keep_last = keep_last
        self.clock = clock
        self.seed = seed
        self.config = config
        self.save_last = save_last
        self.trajectories_seen = 0
        self.scored_tokens_seen = 0
        self.checkpoints_written = 0
        self.last_checkpoint_gpu_s = 0.0
        self.last_checkpoint_update: int | None = None
        self.last_checkpoint_path: Path | None = None
        self._gpu_s_before_start = 0.0  # GPU-clock consumed by earlier runs this one resumed from
        self._started_at: float | None = None
        self._world_devices = 1
        self._requested = False
        self._published_at: float | None = None
        self._publication_s: float | None = None

    # ----------------------------------------------------------------- the clock
    @property
    def gpu_clock_s(self) -> float:
        """GPU-clock seconds trained so far, earlier runs included: wall clock since ``on_train_start`` × devices."""
        if self._started_at is None:
            return self._gpu_s_before_start
        return self._gpu_s_before_start + (self.clock() - self._started_at) * (self.devices or self._world_devices)

    @property
    def due(self) -> bool:
        """Whether this rank would write a checkpoint at the next optimizer boundary."""
        return self._requested or self.gpu_clock_s - self.last_checkpoint_gpu_s >= self.interval_s

    def request(self) -> None:
        """Ask for a checkpoint at the next optimizer boundary, whatever the clock says (honored on global rank 0)."""
        self._requested = True

    # ----------------------------------------------------------------- hooks (Trainer and Fabric)
    def on_train_start(self, trainer: L.Trainer | L.Fabric, pl_module: Any) -> None:
        """The GPU-clock starts (or, after a resume, continues from the restored reading).

        Raises:
            ValueError: under a DeepSpeed or model-parallel (FSDP2) strategy, whose optimizer state (and ZeRO-3 or
                FSDP parameters) are partitioned across ranks: rank 0's state would lose the other partitions.
        """
        if _partitions_state(getattr(trainer, "strategy", None)):
            name = type(trainer.strategy).__name__
            raise ValueError(
                f"GPUClockCheckpoint writes rank 0's replicated module and optimizer state; {name} partitions them "
                "across ranks, so the checkpoint would lose the other partitions. Remove this callback (fit: "
                "checkpoint.enabled=false) or use a replicated strategy (ddp)"
            )
        self._world_devices = trainer.world_size
        self._started_at = self.clock()

    def on_train_batch_end(
        self, trainer: L.Trainer | L.Fabric, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """On :class:`BatchClosed` (stepped and published): count the update's work, then write if due."""
        if not isinstance(batch, BatchClosed):
            return
        self._count_update(trainer, pl_module)
        self._published_at = time.time()  # the publisher, ordered before us, has just had θ_{k+1} acknowledged
        self._publication_s = pl_module.update_timings.get("publication_s")
        # Time-based, so ranks could disagree: rank 0 decides for everyone.
        if trainer.strategy.broadcast(self.due, src=0):
            self.save(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer | L.Fabric, pl_module: Any) -> None:
        """Write the final update's checkpoint (``save_last``) unless it was just written."""
        update = pl_module.num_optimizer_steps - 1
        if self.save_last and update >= 0 and self.last_checkpoint_update != update:
            self.save(trainer, pl_module)

    # ----------------------------------------------------------------- writing
    def save(self, trainer: L.Trainer | L.Fabric, pl_module: Any) -> Path:
        """Write ``update-<k>`` for the update the module last finished, atomically, and prune old ones.

        Call it only at an optimizer boundary (the hooks do). Collective: every rank must call it.

        Raises:
            RuntimeError: If writing failed on any rank; no ``update-<k>`` directory (nor its temporary) is left.
        """
        update = pl_module.num_optimizer_steps - 1
        final = self.dirpath / checkpoint_name(update)
        gpu_clock_s = self.gpu_clock_s
        # The state saved below must already say "checkpointed at update k", or a resumed run would checkpoint again.
        previous = (self.last_checkpoint_gpu_s, self.last_checkpoint_update, self.checkpoints_written)
        self.last_checkpoint_gpu_s, self.last_checkpoint_update = gpu_clock_s, update
        self.checkpoints_written += 1
        failure = self._write(trainer, pl_module, final, update, gpu_clock_s)
        if failure is not None:
            self.last_checkpoint_gpu_s, self.last_checkpoint_update, self.checkpoints_written = previous
            raise RuntimeError(f"GPUClockCheckpoint: writing {final} failed: {failure}")
        self._requested = False
        self.last_checkpoint_path = final
        return final

    def _write(
        self, trainer: L.Trainer | L.Fabric, module: Any, final: Path, update: int, gpu_clock_s: float
    ) -> str | None:
        """Every rank writes its RNG state into ``.tmp-<name>``; rank 0 the rest, then renames it to ``final``.
        Returns rank 0's verdict on every rank: ``None``, or what failed (the temporary directory is then gone)."""
        strategy, rank = trainer.strategy, trainer.global_rank
        tmp = final.with_name(f".tmp-{final.name}")
        error = _attempt(lambda: _fresh_directory(tmp)) if rank == 0 else None
        strategy.barrier()
        if error is None:
            error = _attempt(lambda: save_file(rng_states(), tmp / rng_file(rank)))
        all_ok = strategy.reduce_boolean_decision(error is None, all=True)  # also the barrier before rank 0 renames
        if rank == 0:
            if error is None and not all_ok:
                error = "another rank failed to write its RNG state"
            if error is None:
                error = _attempt(lambda: self._write_shared(trainer, module, tmp, final, update, gpu_clock_s))
            if error is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return strategy.broadcast(error, src=0)

    def _write_shared(
        self, trainer: L.Trainer | L.Fabric, module: Any, tmp: Path, final: Path, update: int, gpu_clock_s: float
    ) -> None:
        """Rank 0: the module, optimizer and callback states and ``meta.json``; then rename into place and prune."""
        state = {
            "format_version": FORMAT_VERSION,
            "state_dict": module.state_dict(),
            "optimizer_states": [optimizer.state_dict() for optimizer in _optimizers_of(module)],
            "callbacks": {cb.state_key: cb.state_dict() for cb in checkpointed_callbacks(trainer)},
            "policy_version": module.policy_version,
            "num_optimizer_steps": module.num_optimizer_steps,
            "next_update": update + 1,  # the data position: task order and sampling seeds derive from it
        }
        save_file(state, tmp / STATE_FILE)
        write_meta(self._meta(module, update, gpu_clock_s), tmp / META_FILE)
        install_directory(tmp, final)
        if self.keep_last is not None:
            prune(self.dirpath, self.keep_last)

    def _meta(self, module: Any, update: int, gpu_clock_s: float) -> dict[str, Any]:
        config = self._resolved_config()
        return {
            "format_version": FORMAT_VERSION,
            "seed": self.seed if self.seed is not None else config.get("seed"),
            "update": update,
            "next_update": update + 1,
            "policy_version": module.policy_version,
            "policy_hash": policy_hash(getattr(module, "policy", module)),
            "published_at": self._published_at,
            "publication_s": self._publication_s,
            "trajectories_seen": self.trajectories_seen,
            "scored_tokens_seen": self.scored_tokens_seen,
            "gpu_clock_s": gpu_clock_s,
            "devices": self.devices or self._world_devices,
            "written_at": time.time(),
            "state_file": STATE_FILE,
            "config": config,
        }

    def _resolved_config(self) -> dict[str, Any]:
        if self.config is None:
            return {}
        if isinstance(self.config, Mapping):
            return dict(self.config)
        return json.loads(Path(self.config).read_text())

    def _count_update(self, trainer: L.Trainer | L.Fabric, module: Any) -> None:
        """Add the finished update's trajectories and scored tokens (this rank's service log, summed over ranks)."""
        records = module.service_log
        trajectories = len({(r.group_id, r.trajectory_index) for r in records})
        tokens = sum(r.scored_tokens for r in records)
        trajectories, tokens = _sum_over_ranks(trainer, [trajectories, tokens])
        self.trajectories_seen += trajectories
        self.scored_tokens_seen += tokens

    # ----------------------------------------------------------------- callback state
    def state_dict(self) -> dict[str, Any]:
        return {
            "gpu_clock_s": self.gpu_clock_s,
            "last_checkpoint_gpu_s": self.last_checkpoint_gpu_s,
            "last_checkpoint_update": self.last_checkpoint_update,
            "checkpoints_written": self.checkpoints_written,
            "trajectories_seen": self.trajectories_seen,
            "scored_tokens_seen": self.scored_tokens_seen,
            "published_at": self._published_at,
            "publication_s": self._publication_s,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._gpu_s_before_start = state_dict["gpu_clock_s"]
        self._started_at = None  # the clock resumes at on_train_start
        self.last_checkpoint_gpu_s = state_dict["last_checkpoint_gpu_s"]
        self.last_checkpoint_update = state_dict["last_checkpoint_update"]
        self.checkpoints_written = state_dict["checkpoints_written"]
        self.trajectories_seen = state_dict["trajectories_seen"]
        self.scored_tokens_seen = state_dict["scored_tokens_seen"]
        self._published_at = state_dict["published_at"]
        self._publication_s = state_dict["publication_s"]


def _attempt(write: Callable[[], None]) -> str | None:
    """Run ``write``; the error as a message every rank can receive, or ``None``."""
    try:
        write()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _fresh_directory(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)  # left by a run that died while writing
    path.mkdir(parents=True)


def _optimizers_of(module: Any) -> list[torch.optim.Optimizer]:
    optimizers = module.optimizers()
    return list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]


def checkpointed_callbacks(trainer: L.Trainer | L.Fabric) -> list[L.Callback]:
    """The callbacks whose state a checkpoint holds and a resume restores, keyed by ``state_key``.

    (Fabric has no public accessor; its ``_callbacks`` also lists the LightningModule, which is not a ``Callback`` and
    is saved as ``state_dict``.)
    """
    callbacks = trainer.callbacks if isinstance(trainer, L.Trainer) else trainer._callbacks
    return [cb for cb in callbacks if isinstance(cb, L.Callback)]


def _sum_over_ranks(trainer: L.Trainer | L.Fabric, values: list[int]) -> list[int]:
    """Each rank served its own sources. (Fabric's strategy names the collective ``all_reduce``.)"""
    if trainer.world_size == 1:
        return values
    strategy = trainer.strategy
    reduce = getattr(strategy, "all_reduce", None) or strategy.reduce
    tensor = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
    return [round(v) for v in reduce(tensor, reduce_op="sum").tolist()]


def _partitions_state(strategy: Any) -> bool:
    from lightning.fabric import strategies as fabric
    from lightning.pytorch import strategies as trainer

    partitioned = (
        fabric.DeepSpeedStrategy,
        fabric.FSDPStrategy,
        fabric.ModelParallelStrategy,
        trainer.DeepSpeedStrategy,
        trainer.FSDPStrategy,
        trainer.ModelParallelStrategy,
    )
    return isinstance(strategy, partitioned)
