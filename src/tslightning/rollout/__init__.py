"""Rollout side: engines with versioned weight publication, the multi-turn agent loop, teacher scoring and the
rollout DataModule that yields ready sources.

One folder per engine, named after its ``rollout.engine`` value (``hf/``, ``vllm_engine/``, ``vllm_server/``; the
interface is :mod:`tslightning.rollout.engine`), the OpenAI-compatible gateway (``gateway/``) and the harnesses that
train through it (``harness/``). Each folder states its rule in its docstring.

Layer: beside the learner, above ``distributed``. May import ``distributed`` (rank assignment), ``core``,
``objectives``, ``tasks`` and ``sandbox``; never the learner, callbacks, the loop or commands.
"""
