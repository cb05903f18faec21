"""The batch-synchronous replay of what a multi-rank ``fit --record_batches true`` recorded: the reference a run's
parameters are compared with (App. G protocol, across ranks)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed
from tslightning.learner.settings import OptimizerSettings
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.loop.batch_recording import load_batches
from tslightning.models.tiny_model import load_tiny_model

QUICKSTART = Path(__file__).parents[2] / "configs" / "quickstart.yaml"


def sync_replay_of_every_rank(
    out: Path, updates: int, dtype: torch.dtype = torch.float32
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """θ after ``updates`` sync updates in one process on the union of every rank's recorded batches (from
    ``out/batches``), starting from ``out/policy-0`` in ``dtype`` with the quickstart's optimizer; and that θ_0."""
    config = yaml.safe_load(QUICKSTART.read_text())
    policy, _ = load_tiny_model(out / "policy-0")
    policy = policy.to(dtype)
    initial = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    settings = OptimizerSettings(**{**config["optimizer"], "betas": tuple(config["optimizer"]["betas"])})
    module = StreamingPolicyModule(policy, "grpo", "sync", max_grad_norm=config["max_grad_norm"], optimizer=settings)
    optimizer = module.configure_optimizers()
    for update in range(updates):
        ranks = load_batches(out / "batches", update)
        plans = [items[0] for items in ranks.values()]
        groups = {g: m for plan in plans for g, m in plan.group_sizes.items()}
        module.ingest(BatchPlan(plans[0].objective, plans[0].policy_version, groups))
        for items in ranks.values():
            for item in items[1:]:
                if not isinstance(item, BatchClosed):
                    module.ingest(item)
        module.ingest(BatchClosed(plans[0].policy_version))
        module.barrier(optimizer)
    return {name: tensor.detach() for name, tensor in policy.state_dict().items()}, initial
