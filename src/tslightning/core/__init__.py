"""The learner's core types and accumulators: stream items (sources and completion events), the logical batch's plan
and registry, the flat parameter layout, the exact running statistics they fold into (G1/G2 per GRPO group, Eq. 7;
the unnormalized OPD sum, Eq. 9) and recorded batches for replay (App. G).

Layer: below ``distributed`` and ``learner``, which both use these types. May import ``objectives`` only.
"""
