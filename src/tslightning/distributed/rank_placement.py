"""Where one learner rank's processes run on its node: its even share of the node's cores and GPUs.

Node-wide lists in the settings (``learner.cpus``, ``rollout.cpus``, ``rollout.vllm.gpus``) are split among the
node's learner ranks in local-rank order, so two ranks never bind the same cores or start their engines on the same
GPU: with ``learner.devices: 2`` and ``rollout.cpus: [2, 3]``, local rank 0's rollout runs on core 2 and local rank
1's on core 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

LEARNER_RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
"""A learner rank's torch.distributed variables. Processes a rank starts that are not ranks (a vLLM engine process,
a harness) start without them: a vLLM process starts its own one-rank group, a harness that uses torch stays out of
the learners' process group."""


@dataclass(frozen=True)
class RankPlacement:
    """One learner rank's place on its node.

    Attributes:
        local_rank: This rank's index among the node's learner ranks.
        local_ranks: Learner ranks on the node (``learner.devices``).
    """

    local_rank: int
    local_ranks: int

    def share(self, node_ids: Sequence[int] | None) -> list[int] | None:
        """This rank's contiguous, even share of ``node_ids`` (``None`` stays ``None``: no placement)."""
        if node_ids is None:
            return None
        size = len(node_ids) // self.local_ranks
        return list(node_ids[self.local_rank * size : (self.local_rank + 1) * size])


def share_problems(setting: str, node_ids: Sequence[int] | None, local_ranks: int, per_rank: int = 1) -> list[str]:
    """Why ``node_ids`` cannot be split evenly among ``local_ranks`` ranks, ``per_rank`` at least each (empty: it can).

    Args:
        setting: The setting's name, for the message (e.g. ``rollout.cpus``).
        node_ids: The node-wide list, or ``None`` (nothing to split).
        local_ranks: Learner ranks per node.
        per_rank: Least ids one rank needs (e.g. ``tensor_parallel_size`` GPUs); a multiple of it each.
    """
    if node_ids is None:
        return []
    if len(set(node_ids)) != len(node_ids) or min(node_ids, default=0) < 0:
        return [f"{setting} must list distinct ids >= 0; got {list(node_ids)}"]
    if not node_ids or len(node_ids) % local_ranks or (len(node_ids) // local_ranks) % per_rank:
        need = f"{per_rank} x {local_ranks}" if per_rank > 1 else f"{local_ranks}"
        return [
            f"{setting} lists {len(node_ids)} id(s) for {local_ranks} learner rank(s) per node; give a non-empty "
            f"multiple of {need} (each rank takes an even share), or null"
        ]
    return []
