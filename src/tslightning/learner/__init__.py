"""The streaming learner: :class:`~tslightning.learner.streaming_module.StreamingPolicyModule` serves each ready
source's backward at the fixed snapshot θ_k, folds it into the core accumulators, and at the barrier reduces,
normalizes, clips and takes one optimizer step (Eq. 3); with the boundary-adjoint context backward (App. I), GRPO
group admission (App. D.3) and the float64 norm patch exactness checks need.

Layer: above ``distributed``. May import ``distributed``, ``core``, ``objectives`` and ``measure``; never rollout,
callbacks, the loop or commands.
"""
