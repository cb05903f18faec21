"""Rollout side: engines with versioned weight publication, the multi-turn agent loop, the OpenAI-compatible gateway
an external agent harness trains through (``gateway/``), teacher scoring and the rollout DataModule that yields ready
sources.

Layer: beside the learner, above ``distributed``. May import ``distributed`` (rank assignment), ``core``,
``objectives``, ``tasks`` and ``sandbox``; never the learner, callbacks, the loop or commands.
"""
