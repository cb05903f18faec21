"""A test callback: at the end of training each rank saves its policy's full parameters (``theta-rank<r>.pt``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from tslightning.callbacks.published_weights import PublishedWeights


class ParameterDump(L.Callback):
    """Saves ``pl_module.policy``'s full weights as a replica serves them on every rank when training ends: sharded
    parameters (FSDP2, ZeRO-3) gathered whole (a collective: every rank runs it), LoRA adapters merged.

    Args:
        path: Directory of the ``theta-rank<r>.pt`` files.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module) -> None:
        weights = PublishedWeights(pl_module.policy, pl_module.placement)  # what a replica serves: LoRA merged
        state = {name: tensor.detach().cpu().clone() for name, tensor in weights}
        self.path.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.path / f"theta-rank{trainer.global_rank}.pt")
