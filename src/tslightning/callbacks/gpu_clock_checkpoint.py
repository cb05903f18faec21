"""Checkpoints on a GPU-clock schedule, written only at optimizer boundaries.

GPU-clock is training wall clock × learner devices: with ``interval_s=3600`` (one GPU-hour) a run on 8 devices
checkpoints every 7.5 minutes of wall clock, one on a single device every hour. A checkpoint becomes *due* when the
GPU-clock since the last one reaches the interval (or :meth:`GPUClockCheckpoint.request` is called); it is *written*
at the end of the next update — after its step and the publication of θ_{k+1} — never in the middle of one, so it
holds no half-folded statistics and a resumed run restarts at a clean update boundary. The decision is made on global
rank 0 and broadcast (a clock-based decision ranks could disagree on).

It is no Lightning ``Checkpoint`` and replaces nothing: a Trainer keeps its default ``ModelCheckpoint``,
``enable_checkpointing`` and ``ckpt_path="last"``/``"best"``. Where it writes:

* under a ``Trainer``: ``dirpath/update-<k>.ckpt`` through ``trainer.save_checkpoint`` — the strategy and its
  ``CheckpointIO`` (fsspec paths, sharded strategies, every callback's ``on_save_checkpoint``); the GPU-clock record
  (``meta``) rides in the checkpoint under ``"gpu_clock_checkpoint"``. Resume with
  ``trainer.fit(model, ckpt_path=".../update-<k>.ckpt")``.
* in a Fabric loop: the ``update-<k>/`` directory of :mod:`tslightning.callbacks.checkpoint_state`, its
  ``state.pt`` written through the Fabric strategy's ``save_checkpoint`` (as ``fabric.save``) — rank 0's file under
  DDP, every rank's shards under FSDP2 (``ModelParallelStrategy``) and DeepSpeed ZeRO
  (:mod:`tslightning.callbacks.checkpoint_layout`) — resumed with
  :func:`~tslightning.callbacks.checkpoint_state.restore_checkpoint` (``fabric.load``).
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
from lightning.fabric.wrappers import _unwrap_objects

from tslightning.callbacks.checkpoint_layout import REPLICATED, layout_of, sharded_state
from tslightning.callbacks.checkpoint_state import (
    FORMAT_VERSION,
    META_FILE,
    STATE_FILE,
    checkpoint_file_name,
    checkpoint_files,
    checkpoint_name,
    install_directory,
    policy_hash,
    prune,
    rng_file,
    rng_states,
    save_file,
    write_meta,
)
from tslightning.callbacks.update_callback import UpdateCallback, callbacks_of, held_version, sum_over_ranks

TRAINER_META_KEY = "gpu_clock_checkpoint"
"""Where a Trainer checkpoint holds the GPU-clock record (the Fabric layout's ``meta.json``)."""


class GPUClockCheckpoint(UpdateCallback):
    """Writes update k's checkpoint every ``interval_s`` of GPU-clock, at the end of the update.

    Put it after every callback whose state it saves (checked at the first hook: a callback after it that keeps state
    and acts at batch end is refused). The meta record holds ``seed``, ``update``, ``next_update``,
    ``policy_version``, ``policy_hash``, ``published_at`` (Unix time when the replicas had acknowledged that version),
    ``publication_s``, ``trajectories_seen`` and ``scored_tokens_seen`` (cumulative over all ranks and all updates,
    across resumes; counted from the module's ``service_log``, ``None`` without one), ``gpu_clock_s``, ``devices``,
    ``written_at`` and the resolved run ``config``.

    Args:
        dirpath: Directory of the checkpoints (created when missing); under a Trainer any fsspec URL.
        interval_s: GPU-clock seconds between checkpoints (one hour × number of GPUs, i.e. 3600).
        devices: Learner devices the wall clock is multiplied by; ``None`` uses the world size.
        keep_last: How many newest checkpoints to keep; ``None`` keeps all.
        clock: Monotonic seconds (patch it in tests).
        seed: The run seed recorded in the meta record (``None``: the config's ``seed``, if any).
        config: The resolved run config recorded in the meta record: a mapping, or the path of a JSON file read when
            each checkpoint is written (the fit loop's ``<out_dir>/config.json``).
        save_last: Also write a checkpoint when training ends, unless the last update already has one.
        name: Distinguishes several checkpointers in a checkpoint (their ``state_key``).
    """

    reads_publication = True

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
        name: str | None = None,
    ) -> None:
        super().__init__()
        problems = []
        if not interval_s > 0:
            problems.append(f"interval_s must be > 0 GPU-clock seconds (3600: one GPU-hour); got {interval_s}")
        if devices is not None and (not isinstance(devices, int) or devices < 1):
            problems.append(f"devices must be an int >= 1 or None (the world size); got {devices!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            problems.append(f"keep_last must be an int >= 1 or None (keep all); got {keep_last!r}")
        if problems:
            raise ValueError("GPUClockCheckpoint: " + "; ".join(problems))
        self.dirpath: Path | str = str(dirpath) if "://" in str(dirpath) else Path(dirpath)
        self.interval_s = float(interval_s)
        self.devices = devices
        self.keep_last = keep_last
        self.clock = clock
        self.seed = seed
        self.config = config
        self.save_last = save_last
        self.name = name
        self.trajectories_seen: int | None = 0
        self.scored_tokens_seen: int | None = 0
        self.checkpoints_written = 0
        self.last_checkpoint_gpu_s = 0.0
        self.last_checkpoint_update: int | None = None
        self.last_checkpoint_path: Path | str | None = None
        self._gpu_s_before_start = 0.0  # GPU-clock consumed by earlier runs this one resumed from
        self._started_at: float | None = None
        self._world_devices = 1
        self._requested = False
        self._published_at: float | None = None
        self._publication_s: float | None = None

    @property
    def state_key(self) -> str:
        return type(self).__qualname__ if self.name is None else self._generate_state_key(name=self.name)

    # ----------------------------------------------------------------- the clock
    @property
    def gpu_clock_s(self) -> float:
        """GPU-clock seconds trained so far, earlier runs included: wall clock since ``on_train_start`` × devices."""
        if self._started_at is None:
            return self._gpu_s_before_start
        return self._gpu_s_before_start + (self.clock() - self._started_at) * (self.devices or self._world_devices)

    @property
    def due(self) -> bool:
        """Whether this rank would write a checkpoint at the end of the next update."""
        return self._requested or self.gpu_clock_s - self.last_checkpoint_gpu_s >= self.interval_s

    def request(self) -> None:
        """Ask for a checkpoint at the next optimizer boundary, whatever the clock says (honored on global rank 0)."""
        self._requested = True

    # ----------------------------------------------------------------- hooks (Trainer and Fabric)
    def check_host(self, trainer: Any, pl_module: Any) -> None:
        """Refuse what the checkpoint could not hold.

        Raises:
            ValueError: a callback after this one that keeps state and acts at batch end (its update-k state would
                be missing); in a Fabric loop, Fabric's FSDP1 ``FSDPStrategy`` (FSDP2's ``ModelParallelStrategy``,
                DeepSpeed and DDP are written by :mod:`~tslightning.callbacks.checkpoint_layout`), or an fsspec URL
                ``dirpath``.
        """
        callbacks = callbacks_of(trainer)
        later = callbacks[callbacks.index(self) + 1 :] if self in callbacks else []
        unsaved = [cb for cb in later if _keeps_batch_state(cb) and not isinstance(cb, GPUClockCheckpoint)]
        if unsaved:
            raise ValueError(
                f"GPUClockCheckpoint comes before {type(unsaved[0]).__name__}, whose state changes at the end of every "
                "batch: its checkpoint would miss that update; put GPUClockCheckpoint last"
            )
        if isinstance(trainer, L.Trainer):
            return
        layout_of(getattr(trainer, "strategy", None))
        if isinstance(self.dirpath, str):
            raise ValueError(
                f"GPUClockCheckpoint: dirpath {self.dirpath!r} is a URL; a Fabric loop writes a local path"
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """The GPU-clock starts (or, after a resume, continues from the restored reading)."""
        super().on_train_start(trainer, pl_module)
        self._world_devices = trainer.world_size
        self._started_at = self.clock()

    def on_update_end(self, trainer: Any, pl_module: Any, k: int, batch: Any) -> None:
        """Update k stepped and was published: count its work, then write if due (rank 0 decides for everyone)."""
        self._count_update(trainer, pl_module)
        publication = self.publication(trainer, pl_module, k)
        self._published_at = None if publication is None else publication.acknowledged_at
        self._publication_s = None if publication is None else publication.seconds
        if trainer.strategy.broadcast(self.due, src=0):
            self.save(trainer, pl_module)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Write the final update's checkpoint (``save_last``) unless it was just written."""
        super().on_train_end(trainer, pl_module)
        update = self.last_update_index
        if self.save_last and update is not None and self.last_checkpoint_update != update:
            self.save(trainer, pl_module)

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        """A Trainer checkpoint (this callback's or any other's) carries the GPU-clock record."""
        update = self.last_update_index if self.last_update_index is not None else -1
        checkpoint[TRAINER_META_KEY] = self._meta(trainer, pl_module, update, self.gpu_clock_s)

    # ----------------------------------------------------------------- writing
    def save(self, trainer: Any, pl_module: Any) -> Path | str:
        """Write the checkpoint of the update the module last finished (the last one the hooks saw end, else the one
        before the module's ``policy_version``) and prune old ones.

        Call it only at an optimizer boundary (the hooks do). Collective: every rank must call it.

        Raises:
            RuntimeError: If writing failed on any rank; no checkpoint of that update (nor a temporary) is left.
        """
        update = self.last_update_index
        if update is None:  # called directly, outside the hooks: the module's version says which update it finished
            version = held_version(trainer, pl_module)
            update = None if not version else version - 1
        if update is None:
            raise RuntimeError("GPUClockCheckpoint.save: no update has finished yet")
        gpu_clock_s = self.gpu_clock_s
        # The state saved below must already say "checkpointed at update k", or a resumed run would checkpoint again.
        previous = (self.last_checkpoint_gpu_s, self.last_checkpoint_update, self.checkpoints_written)
        self.last_checkpoint_gpu_s, self.last_checkpoint_update = gpu_clock_s, update
        self.checkpoints_written += 1
        if isinstance(trainer, L.Trainer):
            final, failure = self._save_with_trainer(trainer, update)
        else:
            final = Path(self.dirpath) / checkpoint_name(update)
            failure = self._write(trainer, pl_module, final, update, gpu_clock_s)
        if failure is not None:
            self.last_checkpoint_gpu_s, self.last_checkpoint_update, self.checkpoints_written = previous
            raise RuntimeError(f"GPUClockCheckpoint: writing {final} failed: {failure}")
        self._requested = False
        self.last_checkpoint_path = final
        return final

    def _save_with_trainer(self, trainer: L.Trainer, update: int) -> tuple[str, str | None]:
        """``trainer.save_checkpoint`` (every rank: the strategy may shard), then rank 0 prunes through the strategy."""
        final = f"{str(self.dirpath).rstrip('/')}/{checkpoint_file_name(update)}"
        try:
            trainer.save_checkpoint(final)
        except Exception as error:
            return final, f"{type(error).__name__}: {error}"
        if self.keep_last is not None and trainer.is_global_zero:
            for stale in checkpoint_files(self.dirpath)[: -self.keep_last]:
                trainer.strategy.remove_checkpoint(stale)
        return final, None

    def _write(self, fabric: Any, module: Any, final: Path, update: int, gpu_clock_s: float) -> str | None:
        """Every rank writes its RNG state into ``.tmp-<name>`` and hands the state to the strategy (rank 0 writes the
        replicated ``state.pt``; a sharded strategy has every rank write its shards); rank 0 hashes the full
        trainable weights (every rank joins the gathers of sharded ones), writes ``meta.json`` and renames the
        directory to ``final``. Returns rank 0's verdict on every rank: ``None``, or what failed (the temporary
        directory is then gone). A rank failing inside the strategy's collective save fails the others there."""
        strategy, rank = fabric.strategy, fabric.global_rank
        tmp = final.with_name(f".tmp-{final.name}")
        error = _attempt(lambda: _fresh_directory(tmp)) if rank == 0 else None
        strategy.barrier()
        if error is None:
            error = _attempt(lambda: save_file(rng_states(), tmp / rng_file(rank)))
        if error is None:  # no barrier inside (unlike fabric.save), so a failed write is agreed on below
            error = _attempt(lambda: strategy.save_checkpoint(tmp / STATE_FILE, self._state(fabric, module, update)))
        digest: list[str] = []  # rank 0 hashes; every rank takes part when the weights are sharded (gathers)
        if rank == 0 or layout_of(strategy, module) != REPLICATED:
            hashed = _attempt(lambda: digest.append(policy_hash(getattr(module, "policy", module))))
            error = error or hashed
        all_ok = strategy.reduce_boolean_decision(error is None, all=True)  # also the barrier before rank 0 renames
        if rank == 0:
            if error is None and not all_ok:
                error = "another rank failed to write its part"
            if error is None:
                meta = self._meta(fabric, module, update, gpu_clock_s, digest[0])
                error = _attempt(lambda: self._install(meta, tmp, final))
            if error is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return strategy.broadcast(error, src=0)

    def _state(self, fabric: Any, module: Any, update: int) -> dict[str, Any]:
        """``state.pt``: the module (the strategy takes its state dict, or its shards), optimizer and callback states,
        versions."""
        module = _unwrap_objects(module)
        fields = {
            "format_version": FORMAT_VERSION,
            "callbacks": {cb.state_key: cb.state_dict() for cb in checkpointed_callbacks(fabric)},
            "policy_version": getattr(module, "policy_version", update + 1),
            "num_optimizer_steps": getattr(module, "num_optimizer_steps", update + 1),
            "next_update": update + 1,  # the data position: task order and sampling seeds derive from it
        }
        if layout_of(fabric.strategy, module) != REPLICATED:
            return sharded_state(fabric, module, fields)
        optimizer_states = [fabric.strategy.get_optimizer_state(o) for o in _optimizers_of(module)]
        return {"state_dict": module, "optimizer_states": optimizer_states, **fields}

    def _install(self, meta: dict[str, Any], tmp: Path, final: Path) -> None:
        write_meta(meta, tmp / META_FILE)
        install_directory(tmp, final)
        if self.keep_last is not None:
            prune(self.dirpath, self.keep_last)

    def _meta(
        self, trainer: Any, module: Any, update: int, gpu_clock_s: float, digest: str | None = None
    ) -> dict[str, Any]:
        """The GPU-clock record; ``digest``: the policy hash every rank computed (``None``: computed here, on every
        rank — a collective for sharded weights)."""
        config = self._resolved_config()
        version = held_version(trainer, module)
        layout = "trainer" if isinstance(trainer, L.Trainer) else layout_of(trainer.strategy, module)  # Lightning's
        return {
            "format_version": FORMAT_VERSION,
            "seed": self.seed if self.seed is not None else config.get("seed"),
            "update": update,
            "next_update": update + 1,
            "policy_version": update + 1 if version is None else version,
            "policy_hash": digest or policy_hash(getattr(module, "policy", module)),
            "published_at": self._published_at,
            "publication_s": self._publication_s,
            "trajectories_seen": self.trajectories_seen,
            "scored_tokens_seen": self.scored_tokens_seen,
            "gpu_clock_s": gpu_clock_s,
            "devices": self.devices or self._world_devices,
            "written_at": time.time(),
            "state_file": STATE_FILE,
            "layout": layout,  # how state.pt is laid out, and for a sharded layout on how many ranks it resumes
            "strategy": type(trainer.strategy).__name__,
            "world_size": trainer.world_size,
            "config": config,
        }

    def _resolved_config(self) -> dict[str, Any]:
        if self.config is None:
            return {}
        if isinstance(self.config, Mapping):
            return dict(self.config)
        return json.loads(Path(self.config).read_text())

    def _count_update(self, trainer: Any, module: Any) -> None:
        """Add the finished update's trajectories and scored tokens (this rank's service log, summed over ranks)."""
        records = getattr(module, "service_log", None)
        if records is None or self.trajectories_seen is None:
            self.trajectories_seen = self.scored_tokens_seen = None  # unknown: the module keeps no service log
            return
        trajectories = len({(r.group_id, r.trajectory_index) for r in records})
        tokens = sum(r.scored_tokens for r in records)
        trajectories, tokens = (round(v) for v in sum_over_ranks(trainer, [trajectories, tokens]))
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
        self.last_update_index = self.last_checkpoint_update
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


def checkpointed_callbacks(trainer: Any) -> list[L.Callback]:
    """The callbacks whose state a checkpoint holds and a resume restores, keyed by ``state_key``."""
    return callbacks_of(trainer)


def _keeps_batch_state(callback: L.Callback) -> bool:
    """Keeps state that changes at the end of a batch (and is no Lightning ``Checkpoint``, which writes its own)."""
    from lightning.pytorch.callbacks import Checkpoint

    def overrides(name: str) -> bool:
        return getattr(type(callback), name, None) is not getattr(L.Callback, name, None)

    batch_end = overrides("on_train_batch_end") or overrides("on_update_end")
    return not isinstance(callback, Checkpoint) and overrides("state_dict") and batch_end
