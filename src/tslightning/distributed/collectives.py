"""Collectives the learner itself issues (not Fabric's): the barrier's one cross-rank sum."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over learner ranks in place and return it (one collective); identity on a single process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor
