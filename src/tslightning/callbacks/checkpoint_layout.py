"""How each Fabric strategy's learner state reaches an ``update-<k>`` checkpoint and comes back.

The module, optimizer and the rest of ``state.pt`` always go through the strategy's own ``save_checkpoint`` and come
back through ``fabric.load``; what ``state.pt`` is on disk depends on the strategy (its *layout*):

* ``replicated`` (DDP, one device): a file, rank 0's copy of the whole θ and AdamW state (every rank holds them).
  It resumes on any number of ranks.
* ``fsdp`` (FSDP2 through ``ModelParallelStrategy``): a torch.distributed.checkpoint directory — every rank writes
  its shards of the module and of the optimizer state (``__<r>_0.distcp``), the coordinator ``.metadata``, rank 0
  the rest (``meta.pt``).
* ``deepspeed_stage_2`` / ``deepspeed_stage_3``: a DeepSpeed checkpoint directory (``latest``, ``checkpoint/``) —
  the engine writes the module and each rank its optimizer partition; the rest is DeepSpeed's client state.

A checkpoint resumes on the layout that wrote it; ``fsdp`` on any number of ranks (torch.distributed.checkpoint
reshards it onto the loading ranks), DeepSpeed's only on the number that wrote it. ``meta.json`` records both, and
:func:`layout_mismatch` says what differs (``fit`` refuses it before anything is written).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.wrappers import _unwrap_objects

REPLICATED = "replicated"
FSDP = "fsdp"
SHARDED_LAYOUTS = (FSDP, "deepspeed_stage_2", "deepspeed_stage_3")
_FIXED_WORLD_SIZE = ("deepspeed_stage_2", "deepspeed_stage_3")
"""Layouts that load only on the number of ranks that wrote them (torch.distributed.checkpoint reshards ``fsdp``)."""
_MODEL_KEY = "state_dict"
_MARKERS = {FSDP: (".metadata", "meta.pt"), "deepspeed_stage_2": ("latest",), "deepspeed_stage_3": ("latest",)}
"""Files a complete sharded ``state.pt`` directory holds (what a cheap check before a resume can look for)."""


def layout_of(strategy: Any, module: Any = None) -> str:
    """The layout ``strategy`` writes: the name of ``module``'s parameter placement when it has one (the streaming
    module's, :mod:`tslightning.distributed.parameter_placement`); else, from the strategy, ``fsdp`` for
    ``ModelParallelStrategy``, ``deepspeed_stage_<n>`` for ``DeepSpeedStrategy``, else ``replicated``.

    Raises:
        ValueError: For Fabric's ``FSDPStrategy`` (FSDP1), whose sharded state this checkpoint does not hold.
    """
    from lightning.fabric.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

    placement = getattr(_unwrap_objects(module), "placement", None) if module is not None else None
    if placement is not None:
        return placement.name

    if isinstance(strategy, ModelParallelStrategy):
        return FSDP
    if isinstance(strategy, DeepSpeedStrategy):
        return f"deepspeed_stage_{strategy.config['zero_optimization']['stage']}"
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "GPUClockCheckpoint: Fabric's FSDPStrategy (FSDP1) shards state this checkpoint cannot hold; use "
            "ModelParallelStrategy (FSDP2, fit's learner.strategy fsdp), DeepSpeed or DDP"
        )
    return REPLICATED


def layout_mismatch(meta: dict[str, Any], layout: str, world_size: int) -> str | None:
    """Why a run of ``layout`` on ``world_size`` ranks cannot resume the checkpoint whose ``meta.json`` is ``meta``
    (``None``: it can). Checkpoints written before the layout was recorded are replicated."""
    written = meta.get("layout", REPLICATED)
    ranks = meta.get("world_size")
    if written != layout:
        return f"it was written in the {written!r} layout and this run writes {layout!r}"
    if written in _FIXED_WORLD_SIZE and ranks != world_size:
        return f"its {written!r} shards are for {ranks} ranks and this run has {world_size}"
    return None


def missing_parts(state: Path, layout: str) -> list[str]:
    """The files a complete sharded ``state`` directory would hold but ``state`` lacks (empty for ``replicated``)."""
    return [name for name in _MARKERS.get(layout, ()) if not (state / name).is_file()]


def sharded_state(fabric: Any, module: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """What a sharded layout hands ``strategy.save_checkpoint``: the model and optimizer *objects* (the strategy
    takes each rank's shards of them) beside the plain ``fields``."""
    model, optimizers = _model_and_optimizers(fabric, module)
    return {_MODEL_KEY: model, **{f"optimizer_{i}": o for i, o in enumerate(optimizers)}, **fields}


def load_sharded(fabric: Any, state: Path, module: Any, fields: tuple[str, ...]) -> dict[str, Any]:
    """Load the sharded ``state`` into the set-up ``module`` and its optimizer(s) in place (``fabric.load``, a
    collective, strict about the module's keys); returns the plain ``fields`` read back (a field the checkpoint
    lacks is absent from it, or raises under FSDP2)."""
    model, optimizers = _model_and_optimizers(fabric, module)
    absent = object()
    objects = {_MODEL_KEY: model, **{f"optimizer_{i}": o for i, o in enumerate(optimizers)}}
    wanted = {**objects, **dict.fromkeys(fields, absent)}
    fabric.load(state, wanted, strict=True)
    return {name: wanted[name] for name in fields if wanted[name] is not absent}


def _model_and_optimizers(fabric: Any, module: Any) -> tuple[torch.nn.Module, list[Any]]:
    """The objects the strategy saves: FSDP2's sharded module and its optimizers, or DeepSpeed's engine and the
    engine's optimizer (which holds this rank's partition).

    Raises:
        RuntimeError: If ``module`` is not the model of the strategy's DeepSpeed engine, or has no optimizer.
    """
    from lightning.fabric.strategies import DeepSpeedStrategy

    module = _unwrap_objects(module)
    if not isinstance(fabric.strategy, DeepSpeedStrategy):
        optimizers = module.optimizers()
        optimizers = list(optimizers) if isinstance(optimizers, list | tuple) else [optimizers]
        if not optimizers:
            raise RuntimeError(
                "GPUClockCheckpoint: the module has no Fabric optimizer (module.optimizers() is empty), so its sharded "
                "optimizer state would be lost; after fabric.setup_module and fabric.setup_optimizers, link them as "
                "fabric.setup does: module._fabric_optimizers = [optimizer]"
            )
        return module, [_unwrap_objects(o) for o in optimizers]
    engine = fabric.strategy.model
    if engine is None or engine.module is not module:
        raise RuntimeError(
            "GPUClockCheckpoint: the module is not the model of the DeepSpeed strategy's engine; set it up with "
            "fabric.setup(module, optimizer) (one engine per module)"
        )
    return engine, [engine.optimizer]


def consolidated_module_state(state: Path, layout: str) -> dict[str, torch.Tensor]:
    """The module's whole state dict from a sharded ``state`` directory, read in one process without a process group
    (the shards of every rank joined): what exporting or evaluating a checkpoint needs. The optimizer state is not
    read under FSDP2; DeepSpeed's ``zero_to_fp32`` reads the float32 master partitions.

    Raises:
        ValueError: For the ``replicated`` layout (``torch.load`` the file instead) or an unknown one.
    """
    if layout == FSDP:
        import torch.distributed.checkpoint as dcp

        reader = dcp.FileSystemReader(str(state))
        prefix = f"{_MODEL_KEY}."
        entries = reader.read_metadata().state_dict_metadata
        template = {
            key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
            for key, entry in entries.items()
            if key.startswith(prefix) and hasattr(entry, "size")
        }
        dcp.load(template, storage_reader=reader, no_dist=True)
        return {key.removeprefix(prefix): tensor for key, tensor in template.items()}
    if layout in SHARDED_LAYOUTS:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(str(state), tag="checkpoint"))
    raise ValueError(f"consolidated_module_state reads a sharded layout ({', '.join(SHARDED_LAYOUTS)}); got {layout!r}")
