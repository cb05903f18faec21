"""A test callback: at the end of training each rank saves its policy's full parameters (``theta-rank<r>.pt``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from tslightning.callbacks.published_weights import full_tensors


class ParameterDump(L.Callback):
    """Saves ``pl_module.policy``'s state dict on every rank when training ends, sharded parameters (FSDP2, ZeRO-3)
    gathered whole (a collective: every rank runs it).

    Args:
        path: Directory of the ``theta-rank<r>.pt`` files.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module) -> None:
        tensors = full_tensors(pl_module.policy, pl_module.placement)
        state = {name: tensor.detach().cpu().clone() for name, tensor in tensors}
        self.path.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.path / f"theta-rank{trainer.global_rank}.pt")
