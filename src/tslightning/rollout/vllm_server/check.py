"""What a vLLM server must offer before the ``vllm_server`` engine uses it, checked before training starts.

:func:`reachability_problems` (run by ``fit``'s preflight, before anything is written) asks each URL of
``rollout.server_urls`` for ``/v1/models`` (and :func:`speculative_server_problems` for how each speculates).
:func:`server_problems` (run when the engine starts, before θ_0 is
published) checks what the protocol needs: the weight-sync routes (``VLLM_SERVER_DEV_MODE=1``), the token-in/token-out
route (``--enable-scale-out``), the weight-transfer backend, log-probs of the sampling distribution
(``--logprobs-mode processed_logprobs``), the context length, the dtype, and that the server serves the same model —
its tokenizer encodes a probe like the policy's does — and, under ``rollout.speculative``, that it speculates with the
run's drafter through an exact sampler (:mod:`~tslightning.rollout.speculative`). Every problem is one line naming
``rollout.server_urls`` and the fix. Plain HTTP (``requests``, imported when a server is asked: it comes with vLLM);
this module imports no vLLM, so the settings can use it in any install.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tslightning.rollout.speculative import SpeculativeSettings, speculative_problems
from tslightning.rollout.vllm_engine.prefill import CPU_SERVER_STEP_TOKENS, prefill_flags, vllm_runs_on_cpu
from tslightning.rollout.vllm_server.client import ServerClient, ServerError

PROBE_TEXT = "Count the lines in file.txt, then print the first error."
"""Text whose token ids the server's tokenizer and the policy's must agree on."""

SERVER_FLAGS = "VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server ... (README: Rollout servers)"

BACKENDS = {"gloo": "tslightning_gloo", "nccl": "nccl"}
"""The server's ``--weight-transfer-config`` backend each ``rollout.server_transport`` needs."""


MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM 0.32 accepts."""


def server_command(
    model: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    transport: str = "gloo",
    dtype: str = "float32",
    max_model_len: int = 4096,
    python: str = "python",
    extra: Sequence[str] = (),
    lora_rank: int | None = None,
    cpu: bool | None = None,
    speculative: SpeculativeSettings | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a vLLM server the ``vllm_server`` engine can use.

    ``python -m vllm.entrypoints.openai.api_server`` (vLLM's ``vllm serve`` entry point crashes with the CPU
    wheel), with the weight-sync routes, token-in/token-out generation, log-probs of the sampling distribution,
    prefix caching and the transport's weight-transfer backend. Add ``--kv-cache-memory-bytes`` (CPU) or
    ``--tensor-parallel-size`` (GPUs) through ``extra``. ``lora_rank`` (a LoRA run's ``model.lora.r``): adapters at
    runtime up to that rank (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``), which LoRA runs publish.
    ``cpu``: the server runs on vLLM's CPU platform (``None``: ask vLLM on this machine, where the server starts);
    it then prefills prompts whole (:mod:`~tslightning.rollout.vllm_engine.prefill`: chunked prefill crashes seeded
    turns there). ``speculative`` (``rollout.speculative``): the drafter and its batch-size schedule, with per-request
    acceptance counts. ``extra`` flags come last and win.
    """
    backend = BACKENDS[transport]
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host, "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(max_model_len), "--enable-scale-out", "--enable-prefix-caching",
        "--logprobs-mode", "processed_logprobs", "--weight-transfer-config", json.dumps({"backend": backend}),
    ]  # fmt: skip
    command += prefill_flags(vllm_runs_on_cpu() if cpu is None else cpu, max_model_len, CPU_SERVER_STEP_TOKENS)
    if transport == "gloo":
        command += [
            "--worker-extension-cls",
            "tslightning.rollout.vllm_server.gloo_transfer.GlooTransferWorkerExtension",
        ]
    environment = {"VLLM_SERVER_DEV_MODE": "1"}
    if lora_rank is not None:
        served = min((rank for rank in MAX_LORA_RANKS if rank >= lora_rank), default=lora_rank)
        command += ["--enable-lora", "--max-lora-rank", str(served)]
        environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if speculative is not None:
        command += speculative.server_flags()
    return command + list(extra), environment


def url_problems(urls: Sequence[str] | None) -> list[str]:
    """Malformed ``rollout.server_urls`` (no request is made)."""
    if not urls:
        return [
            "rollout.server_urls is empty: give the URL of at least one running vLLM server, e.g. "
            "'[http://127.0.0.1:8000]'"
        ]
    problems = []
    for url in urls:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname or parsed.port is None:
            problems.append(f"rollout.server_urls: {url!r} is not an http://host:port URL")
    if len(set(urls)) != len(urls):
        problems.append(f"rollout.server_urls lists a server twice: {list(urls)}")
    return problems


def reachability_problems(urls: Sequence[str], timeout_s: float = 10.0, key: str = "rollout.server_urls") -> list[str]:
    """Each URL that does not answer ``GET /v1/models`` like a vLLM OpenAI-compatible server (``key`` names the
    setting in the message)."""
    import requests  # vLLM's dependency: the vllm_server engine needs vLLM installed

    problems = []
    for url in urls:
        try:
            served, status = ServerClient(url, timeout_s).models(), 200
        except ServerError as error:
            served, status = [], error.status
        except (requests.RequestException, ValueError, KeyError) as error:
            problems.append(
                f"{key}: {url} is unreachable ({type(error).__name__}); start a vLLM server there "
                "(README: Rollout servers) or fix the URL"
            )
            continue
        if not served:
            problems.append(
                f"{key}: {url} answered /v1/models with {status}, not a model list: is it a vLLM OpenAI-compatible "
                "server?"
            )
    return problems


def answers(url: str, timeout_s: float = 5.0) -> bool:
    """Whether the server at ``url`` answers ``GET /health`` (a replica that died does not)."""
    return ServerClient(url, timeout_s).health()


@dataclass(frozen=True)
class Expected:
    """What the learner needs from every server.

    Attributes:
        backend: The weight-transfer backend of the chosen transport.
        dtype: The serving dtype (``float32``, ``bfloat16``, ...).
        context_tokens: Longest prompt plus completion a trajectory can reach.
        probe_ids: The policy tokenizer's ids for :data:`PROBE_TEXT`.
        speculative: The run's ``rollout.speculative`` (``None``: the server must not speculate).
    """

    backend: str
    dtype: str
    context_tokens: int
    probe_ids: tuple[int, ...]
    speculative: SpeculativeSettings | None = None


def server_problems(url: str, expected: Expected, timeout_s: float = 30.0) -> list[str]:
    """Everything ``url`` lacks for serving this run (empty: it can serve); see the module docstring."""
    import requests

    server = ServerClient(url, timeout_s)
    try:
        served = server.models()[0]
        try:
            config, paused = server.config(), server.is_paused()
        except ServerError:
            return [
                f"rollout.server_urls: {url} has no weight-sync routes (/server_info, /is_paused): start it with "
                f"VLLM_SERVER_DEV_MODE=1 ({SERVER_FLAGS})"
            ]
        tokens = server.tokenize(PROBE_TEXT)
        if paused:
            return [
                f"rollout.server_urls: {url} is paused (a publication failed there, or another trainer is updating "
                "it): restart it, or POST /resume if its weights are known to be whole"
            ]
        probe = {"token_ids": list(expected.probe_ids), "sampling_params": {"max_tokens": 1, "detokenize": False}}
        refused = _refusal(server, probe)
    except (requests.RequestException, ServerError, ValueError, KeyError, IndexError) as error:
        return [f"rollout.server_urls: {url} did not answer like a vLLM server ({type(error).__name__}: {error})"]
    problems = _config_problems(url, config, expected)
    if expected.speculative is not None and not problems and (config.get("device_config") or {}).get("device") == "cpu":
        problems += _sampler_problems(server)  # GPUs run vLLM's Triton sampler
    if tuple(tokens) != expected.probe_ids:
        problems.append(
            f"rollout.server_urls: {url} serves another model ({served.get('root') or served.get('id')}): its "
            f"tokenizer encodes a probe as {list(tokens)[:8]}..., the policy's as {list(expected.probe_ids)[:8]}...; "
            "start it on the policy's checkpoint (model.path, or <out_dir>/policy-0)"
        )
    if refused is not None:
        problems.append(
            f"rollout.server_urls: {url} refused token-in/token-out generation ({refused.status}: "
            f"{refused.text[:200]}); start it with --enable-scale-out"
        )
    return problems


def speculative_server_problems(
    urls: Sequence[str], settings: SpeculativeSettings | None, timeout_s: float = 10.0
) -> list[str]:
    """Each server of ``urls`` that answers ``/server_info`` but speculates otherwise than ``settings`` (``fit``'s
    preflight; an unreachable server is :func:`reachability_problems`' to report)."""
    import requests

    problems = []
    for url in urls:
        try:
            config = ServerClient(url, timeout_s).config()
        except (requests.RequestException, ServerError, ValueError, KeyError):
            config = None
        if config is not None:
            problems += speculative_problems(url, config, settings)
    return problems


def _refusal(server: ServerClient, probe: dict[str, Any]) -> ServerError | None:
    """How the token-in route refused ``probe`` (``None``: it generated)."""
    try:
        server.generate(probe)
    except ServerError as error:
        return error
    return None


def _sampler_problems(server: ServerClient) -> list[str]:
    """A speculating server whose workers' rejection sampler is not exact (vLLM's CPU platform without
    tslightning's plugin, :mod:`~tslightning.rollout.vllm_engine.cpu_sampling`)."""
    try:
        results = server.collective_rpc("tslightning_sampler_is_exact")
    except ServerError:
        results = []
    if results and all(str(result) == "True" for result in results):
        return []
    return [
        f"rollout.server_urls: {server.url} speculates through a rejection sampler that does not keep the policy's "
        "distribution (vLLM's CPU expand fallback, or a server without tslightning's worker extension): install "
        "tslightning where the server runs (its vLLM plugin repairs the sampler) and restart it"
    ]


def _config_problems(url: str, config: dict[str, Any], expected: Expected) -> list[str]:
    model = config["model_config"]
    backend = (config.get("weight_transfer_config") or {}).get("backend")
    problems = speculative_problems(url, config, expected.speculative)
    if backend != expected.backend:
        problems.append(
            f"rollout.server_urls: {url} runs weight-transfer backend {backend!r}, rollout.server_transport needs "
            f'{expected.backend!r}: start it with --weight-transfer-config \'{{"backend": "{expected.backend}"}}\''
            + (
                " --worker-extension-cls tslightning.rollout.vllm_server.gloo_transfer.GlooTransferWorkerExtension"
                if expected.backend == "tslightning_gloo"
                else ""
            )
        )
    if model.get("logprobs_mode") != "processed_logprobs":
        problems.append(
            f"rollout.server_urls: {url} returns {model.get('logprobs_mode')!r} log-probs, not those of "
            "the sampling distribution: start it with --logprobs-mode processed_logprobs"
        )
    if int(model.get("max_model_len") or 0) < expected.context_tokens:
        problems.append(
            f"rollout.server_urls: {url} serves {model.get('max_model_len')} tokens of context, a "
            f"trajectory needs {expected.context_tokens}: start it with --max-model-len "
            f"{expected.context_tokens} (or lower rollout.max_context_tokens)"
        )
    scheduler = config.get("scheduler_config") or {}
    if (config.get("device_config") or {}).get("device") == "cpu" and scheduler.get("enable_chunked_prefill"):
        flags = " ".join(prefill_flags(True, int(model.get("max_model_len") or 0), CPU_SERVER_STEP_TOKENS))
        problems.append(
            f"rollout.server_urls: {url} runs on CPU with chunked prefill, where vLLM 0.32 crashes when it splits a "
            f"seeded prompt over steps: start it with {flags}"
        )
    dtype = str(model.get("dtype", "")).removeprefix("torch.")
    if dtype != expected.dtype:
        problems.append(
            f"rollout.server_urls: {url} serves {dtype}, the learner's serving dtype is "
            f"{expected.dtype}: start it with --dtype {expected.dtype}"
        )
    return problems


def probe_ids(policy_dir: Path) -> tuple[int, ...]:
    """The policy tokenizer's ids for :data:`PROBE_TEXT` (what each server's tokenizer must give too)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    return tuple(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])
