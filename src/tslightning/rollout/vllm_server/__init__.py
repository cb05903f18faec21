"""The ``vllm_server`` engine (``rollout.engine: vllm_server``): vLLM's own OpenAI-compatible servers driven over HTTP
(:mod:`~tslightning.rollout.vllm_server.client` owns every route), the checks a server must pass before training,
weight publication through vLLM's weight-transfer protocol (gloo or NCCL), LoRA adapters at runtime, session routing,
and the Ray launcher that starts servers as replicas.

Rule: vLLM and Ray are imported only here (and under ``vllm_engine/``), and only inside functions or modules that
settings never import.
"""
