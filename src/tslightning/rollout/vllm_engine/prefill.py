"""How the vLLM engines prefill prompts: whole on vLLM's CPU platform, in chunks (vLLM's default) on GPUs.

When a prompt's prefill is split over steps (chunked prefill), vLLM 0.32's model runner drops the token sampled at the
end of a partial step and rewinds that request's seeded generator (``gen.set_offset(gen.get_offset() - 4)`` in
``_bookkeeping_sync``). CUDA generators have an offset (Philox); CPU generators do not, and the engine dies with
``RuntimeError: CPU Generator does not use offset`` the first time the prompts scheduled in one step exceed its token
budget (2,048 for a server, 4,096 in process by default), since every turn these engines submit is seeded. So on CPU
each prompt is prefilled whole: chunked prefill off, with a step budget of at least the context length (vLLM requires
it then); a prompt that does not fit in a step's remaining budget waits for the next step.
"""

from __future__ import annotations

CPU_SERVER_STEP_TOKENS = 2048
"""Prompt tokens per step of a CPU server at least (vLLM's CPU default for its OpenAI server)."""
CPU_IN_PROCESS_STEP_TOKENS = 4096
"""Prompt tokens per step of the in-process CPU engine at least (vLLM's CPU default for its ``LLM`` class)."""


def prefill_settings(cpu: bool, max_model_len: int, step_tokens: int) -> dict[str, bool | int]:
    """The ``vllm.LLM`` arguments for an engine of ``max_model_len`` tokens: none on GPUs; on CPU, chunked prefill
    off and at least ``max(max_model_len, step_tokens)`` prompt tokens per step."""
    if not cpu:
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, step_tokens)}


def prefill_flags(cpu: bool, max_model_len: int, step_tokens: int) -> list[str]:
    """:func:`prefill_settings` as ``api_server`` flags."""
    settings = prefill_settings(cpu, max_model_len, step_tokens)
    if not settings:
        return []
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(settings["max_num_batched_tokens"])]


def vllm_runs_on_cpu() -> bool:
    """Whether vLLM serves on its CPU platform on this machine (imports vLLM: ask where the engine or server starts)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


__all__ = [
    "CPU_IN_PROCESS_STEP_TOKENS",
    "CPU_SERVER_STEP_TOKENS",
    "prefill_flags",
    "prefill_settings",
    "vllm_runs_on_cpu",
]
