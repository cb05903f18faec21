"""The ``hf`` engine (``rollout.engine: hf``): Hugging Face ``generate`` in the learner's process or in replica
processes, with a per-session prefix cache.

Rule: imports torch and transformers only; never vLLM or Ray.
"""
