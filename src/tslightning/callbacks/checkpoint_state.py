"""What one checkpoint holds, how it reaches disk atomically, and how a run resumes from it.

Under a ``Trainer`` a GPU-clock checkpoint is Lightning's own ``update-<k>.ckpt`` (``trainer.save_checkpoint``;
resume with ``trainer.fit(ckpt_path=...)``). In a Fabric loop it is a directory ``update-<k>`` written after update
k's optimizer step and publication::

    update-<k>/
        state.pt        # module state_dict, optimizer_states, callbacks, policy_version, num_optimizer_steps,
                        # next_update (the data position: k + 1)
        rng-rank<r>.pt  # python random, numpy (if installed), torch CPU and CUDA generator states of rank r
        meta.json       # seed, update, policy version and hash, publication time, trajectories and scored tokens
                        # seen, GPU-clock seconds, the resolved run config

It is assembled in ``.tmp-update-<k>`` beside it and renamed into place with ``os.replace``, so a directory named
``update-<k>`` is always complete. ``state.pt`` goes through the Fabric strategy's ``save_checkpoint`` (what
``fabric.save`` does) and comes back through ``fabric.load``. Under DDP (or one device) the learner is replicated —
every rank holds the full θ and AdamW state, which publication relies on too — so ``state.pt`` is rank 0's file,
which ``torch.load`` reads without Lightning too. Under FSDP2 and DeepSpeed ZeRO ``state.pt`` is the strategy's
sharded directory, every rank writing its shards (:mod:`tslightning.callbacks.checkpoint_layout`); ``meta.json``
then records the ``layout`` and ``world_size`` (DeepSpeed's shards resume on that many ranks only). A file that
cannot be read, or lacks a field, raises :class:`CheckpointError` naming the file and what is wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem

from tslightning.callbacks.checkpoint_layout import REPLICATED, layout_mismatch, layout_of, load_sharded

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
META_FILE = "meta.json"
_CHECKPOINT_DIR = re.compile(r"update-(\d+)")
_CHECKPOINT_FILE = re.compile(r"update-(\d+)\.ckpt")
_STATE_FIELDS = ("state_dict", "optimizer_states", "callbacks", "policy_version", "num_optimizer_steps", "next_update")
_META_FIELDS = ("policy_hash",)


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message names the file and what is wrong, on one line."""


def checkpoint_name(update: int) -> str:
    """The directory name of the (Fabric loop's) checkpoint written after update ``update``."""
    return f"update-{update}"


def checkpoint_file_name(update: int) -> str:
    """The file name of the Trainer checkpoint written after update ``update``."""
    return f"update-{update}.ckpt"


def checkpoint_files(dirpath: str | os.PathLike[str]) -> list[str]:
    """The Trainer checkpoints ``update-<k>.ckpt`` in ``dirpath`` (any fsspec path), oldest update first."""
    fs = get_filesystem(str(dirpath))
    if not fs.isdir(str(dirpath)):
        return []
    found = []
    for path in fs.ls(str(dirpath), detail=False):
        match = _CHECKPOINT_FILE.fullmatch(str(path).rstrip("/").rsplit("/", 1)[-1])
        if match:
            found.append((int(match.group(1)), f"{str(dirpath).rstrip('/')}/{match.group(0)}"))
    return [path for _, path in sorted(found)]


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def policy_hash(policy: torch.nn.Module) -> str:
    """SHA-256 over the full trainable parameters: each name, dtype, shape and raw bytes, in sorted name order.

    For a peft model that is the adapters. Two policies with equal hashes hold bit-identical trainable weights.
    Sharded parameters (FSDP2 DTensors, ZeRO-3 partitions) are gathered one at a time, so the hash is the same on
    every rank and equals the unsharded policy's — a collective then: every rank must call it.
    """
    digest = hashlib.sha256()
    trainable = sorted(((name, p) for name, p in policy.named_parameters() if p.requires_grad), key=lambda x: x[0])
    for name, parameter in trainable:
        with _full_value(parameter) as full:
            tensor = full.detach().cpu().contiguous()
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes())  # via uint8: numpy has no bfloat16
    return "sha256:" + digest.hexdigest()


@contextmanager
def _full_value(parameter: torch.Tensor) -> Iterator[torch.Tensor]:
    """The whole of ``parameter`` on every rank: an FSDP2 DTensor all-gathered, a ZeRO-3 partition gathered (valid
    inside the context only); any other parameter as it is."""
    from torch.distributed.tensor import DTensor

    if isinstance(parameter, DTensor):
        yield parameter.full_tensor()
    elif hasattr(parameter, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
            yield parameter
    else:
        yield parameter


def rng_states() -> dict[str, Any]:
    """This process's random generator states, in types ``torch.load(weights_only=True)`` accepts."""
    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        name, keys, position, has_gauss, gauss = np.random.get_state()
        states["numpy"] = (name, torch.from_numpy(keys.astype("int64")), position, has_gauss, gauss)
    if torch.cuda.is_available():  # this rank's device only: touching every GPU would open a context on each
        states["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_states` captured (a generator missing on either side is left alone)."""
    random.setstate(_as_tuples(states["python"]))
    torch.set_rng_state(states["torch"])
    if "numpy" in states:
        import numpy as np

        name, keys, position, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "cuda" in states and torch.cuda.is_available():
        device = torch.cuda.current_device()
        state = states["cuda"]
        if isinstance(state, list | tuple):  # an older checkpoint's every-device list
            state = state[device] if device < len(state) else None
        if state is not None:
            torch.cuda.set_rng_state(state, device)


def save_file(obj: Any, path: Path) -> None:
    """``torch.save`` then fsync, so the rename that publishes the directory never precedes the data."""
    with path.open("wb") as file:
        torch.save(obj, file)
        file.flush()
        os.fsync(file.fileno())


def write_meta(meta: Mapping[str, Any], path: Path) -> None:
    with path.open("w") as file:
        json.dump(meta, file, indent=2, default=str)
        file.flush()
        os.fsync(file.fileno())


def install_directory(tmp: Path, final: Path) -> None:
    """Rename a complete ``tmp`` directory to ``final``; a stale ``final`` (from an abandoned timeline — a run resumed
    from an older checkpoint writes the same names again) is moved aside first and then deleted."""
    stale = None
    if final.exists():
        stale = final.with_name(f".stale-{final.name}")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(final, stale)
    os.replace(tmp, final)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def checkpoint_dirs(dirpath: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in ``dirpath``, oldest update first."""
    root = Path(dirpath)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_DIR.fullmatch(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def prune(dirpath: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest checkpoints; returns the deleted directories."""
    doomed = checkpoint_dirs(dirpath)[:-keep_last]
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint directory ``path``."""
    return json.loads((Path(path) / META_FILE).read_text())


@dataclass(frozen=True)
class ResumePoint:
    """Where a restored run continues.

    Attributes:
        next_update: The first update index to run (the checkpoint was written after update ``next_update - 1``).
        policy_version: The module's restored version k; the rollout engine must serve θ_k before update k starts.
        meta: The checkpoint's ``meta.json``.
    """

    next_update: int
    policy_version: int
    meta: dict[str, Any]


def restore_checkpoint(
    path: str | os.PathLike[str],
    module: torch.nn.Module,
    optimizers: Iterable[torch.optim.Optimizer],
    callbacks: Iterable[Any] = (),
    rank: int = 0,
    fabric: Any = None,
) -> ResumePoint:
    """Load a checkpoint directory into a freshly built module, its optimizer(s) and callbacks, and restore RNG.

    Args:
        path: An ``update-<k>`` directory written by :class:`~tslightning.callbacks.GPUClockCheckpoint`.
        module: The :class:`~tslightning.learner.streaming_module.StreamingPolicyModule` (plain or Fabric-wrapped),
            built exactly as in the run that wrote the checkpoint (same model, same LoRA settings).
        optimizers: Its optimizers, in ``configure_optimizers`` order (a sharded layout loads the ones the strategy
            set up with the module).
        callbacks: Callbacks whose ``state_key`` appears in the checkpoint get their ``load_state_dict`` called.
        rank: Global rank of this process: it restores ``rng-rank<rank>.pt`` (rank 0's file when there is none).
        fabric: Read ``state.pt`` through ``fabric.load`` (its strategy's CheckpointIO); ``None``: ``torch.load``.
            Required for a sharded checkpoint, whose layout (and DeepSpeed's world size) it must match (every rank
            calls this then: loading and hashing sharded weights are collectives).

    Raises:
        FileNotFoundError: If ``path`` is not a complete checkpoint directory.
        CheckpointError: If a file of it cannot be read or lacks a field, the optimizers do not match, or a sharded
            checkpoint meets another strategy or world size.
        RuntimeError: If the restored trainable weights do not hash to the checkpoint's ``policy_hash``.
    """
    path = Path(path)
    meta = _checked_meta(path)
    if meta.get("layout", REPLICATED) == REPLICATED:
        state, _ = read_checkpoint(path, fabric)
        _load_replicated(path, state, module, optimizers)
    else:
        state = _load_sharded(path, meta, module, fabric)
    module.policy_version = state["policy_version"]
    module.num_optimizer_steps = state["num_optimizer_steps"]
    for callback in callbacks:  # (Fabric's callback list also holds the set-up LightningModule: no state_key)
        key = getattr(callback, "state_key", None)
        if isinstance(key, str) and key in state["callbacks"]:
            callback.load_state_dict(state["callbacks"][key])
    rng = path / rng_file(rank)
    rng = rng if rng.is_file() else path / rng_file(0)
    set_rng_states(_load(rng, lambda file: torch.load(file, weights_only=True)))
    restored = policy_hash(getattr(module, "policy", module))
    if restored != meta["policy_hash"]:
        raise RuntimeError(
            f"resume: the restored weights hash to {restored} but {path / META_FILE} records {meta['policy_hash']}; "
            "build the policy as the checkpointed run did (model.path, model.lora)"
        )
    return ResumePoint(state["next_update"], state["policy_version"], meta)


def _load_replicated(path: Path, state: dict[str, Any], module: torch.nn.Module, optimizers: Iterable[Any]) -> None:
    module.load_state_dict(state["state_dict"], strict=True)
    optimizers = list(optimizers)
    if len(optimizers) != len(state["optimizer_states"]):
        raise CheckpointError(
            f"resume: {path / STATE_FILE} holds {len(state['optimizer_states'])} optimizer state(s) but the module "
            f"configured {len(optimizers)}"
        )
    for optimizer, optimizer_state in zip(optimizers, state["optimizer_states"], strict=True):
        optimizer.load_state_dict(optimizer_state)


def _load_sharded(path: Path, meta: dict[str, Any], module: torch.nn.Module, fabric: Any) -> dict[str, Any]:
    """``fabric.load`` of a sharded ``state.pt`` into the set-up module and optimizer; its plain fields, checked."""
    if fabric is None:
        raise CheckpointError(f"resume: {path / STATE_FILE} is sharded ({meta['layout']}); restore it through Fabric")
    mismatch = layout_mismatch(meta, layout_of(fabric.strategy, module), fabric.world_size)
    if mismatch is not None:
        raise CheckpointError(f"resume: {path} cannot be restored here: {mismatch}")
    fields = tuple(name for name in _STATE_FIELDS if name not in ("state_dict", "optimizer_states"))
    state = _load(path / STATE_FILE, lambda file: load_sharded(fabric, file, module, fields))
    _require_fields(path / STATE_FILE, state, fields)
    return state


def _checked_meta(path: Path) -> dict[str, Any]:
    """``meta.json`` of checkpoint directory ``path``, which must also hold ``state.pt`` (a file or a directory)."""
    if not (path / STATE_FILE).exists() or not (path / META_FILE).is_file():
        siblings = ", ".join(p.name for p in checkpoint_dirs(path.parent)) or "none"
        raise FileNotFoundError(
            f"resume: {path} is not a checkpoint directory (it needs {STATE_FILE} and {META_FILE}); complete "
            f"checkpoints in {path.parent}: {siblings}"
        )
    meta = _load(path / META_FILE, lambda file: json.loads(file.read_text()))
    _require_fields(path / META_FILE, meta, _META_FIELDS)
    return meta


def read_checkpoint(path: str | os.PathLike[str], fabric: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state.pt`` and ``meta.json`` of a replicated checkpoint directory ``path``, checked for the fields a resume
    reads (a sharded ``state.pt`` loads only into set-up objects: :func:`restore_checkpoint`).

    Raises:
        FileNotFoundError: If ``path`` is not a complete checkpoint directory (the complete ones beside it named).
        CheckpointError: If either file cannot be read (truncated, corrupt, not a checkpoint) or lacks a field.
    """
    path = Path(path)
    meta = _checked_meta(path)
    if meta.get("layout", REPLICATED) != REPLICATED:
        raise CheckpointError(f"resume: {path / STATE_FILE} is sharded ({meta['layout']}); use restore_checkpoint")
    if fabric is not None:
        state = _load(path / STATE_FILE, lambda file: fabric.load(file))
    else:
        state = _load(path / STATE_FILE, lambda file: torch.load(file, map_location="cpu", weights_only=True))
    _require_fields(path / STATE_FILE, state, _STATE_FIELDS)
    return state, meta


def _require_fields(file: Path, content: Any, fields: tuple[str, ...]) -> None:
    missing = [name for name in fields if not isinstance(content, dict) or name not in content]
    if missing:
        raise CheckpointError(
            f"resume: {file} lacks {', '.join(missing)}; it was not written by GPUClockCheckpoint (or is damaged): "
            "resume from another update-<k> directory"
        )


def _load(file: Path, read: Any) -> Any:
    """``read(file)``, any failure turned into one line naming the file and the error."""
    try:
        return read(file)
    except Exception as error:
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:300]
        raise CheckpointError(
            f"resume: cannot read {file} ({reason}); the file is truncated or corrupt: resume from another "
            f"update-<k> directory in {file.parent.parent}"
        ) from error


def _as_tuples(value: Any) -> Any:
    """``random.setstate`` needs tuples; a round trip through some serializers yields lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value
