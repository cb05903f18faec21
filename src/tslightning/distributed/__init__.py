"""Several learner ranks: Fabric strategies (DDP, FSDP2, DeepSpeed ZeRO-2/3 on CPU and GPU), assigning a batch's
groups and trajectories to ranks, per-source gradients of sharded parameters, lock-step ticks for strategies whose
passes are collectives, and failing an update on every rank when one rank fails.

Layer: above ``core``; used by ``learner``, ``rollout`` and ``callbacks``. May import ``core`` and ``objectives``.
"""
