"""The in-process ``vllm`` engine (``rollout.engine: vllm``; the folder is not named ``vllm``, which would shadow the
package): the engine, its worker extension (weights loaded in place), prefill scoring, the host-process environment it
needs, and the vLLM plugin that makes speculative sampling exact on vLLM's CPU platform.

Rule: vLLM is imported only here and under ``vllm_server/``, and only inside functions, so that settings and the CLI
import without it.
"""
