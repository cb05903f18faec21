"""Publication of a LoRA policy's adapter (not merged weights) into running vLLM servers (App. D.2).

A LoRA run trains only the adapter; its base weights never change. So θ_0's base weights are published once with the
weight-transfer protocol (:mod:`tslightning.rollout.vllm_server.publication`), and each later θ_k is the adapter
alone, in peft's format, under a versioned name (:func:`adapter_name`):

1. the learner writes ``<directory>/policy-v<k>/`` (``adapter_config.json`` + ``adapter_model.safetensors``) —
   ``directory`` must be readable at the same path on every server's host (the run directory on loopback, a shared
   file system across hosts): vLLM loads adapters from a path;
2. per server: ``POST /pause?mode=wait`` (requests of θ_{k-1} finish, the prefix cache is cleared) →
   ``POST /v1/load_lora_adapter`` (``tslightning-policy-v<k>``) → ``POST /update_weight_version`` ``"k"`` →
   ``GET /weight_info`` must answer ``"k"`` → ``POST /resume`` → ``POST /v1/unload_lora_adapter`` of θ_{k-1}'s name.

Requests of update k then name ``tslightning-policy-v<k>`` as their ``model``, and the engine checks both the name
the server answered with and the weight version of every sampled token, so a token sampled with another adapter is
refused. Until the first adapter is published (θ_0 of a fresh run, whose peft adapter is zero: ``B = 0``), requests
name the base model, which then is θ_0 exactly.

The servers need LoRA at runtime: ``--enable-lora --max-lora-rank R`` (R ≥ ``model.lora.r``) and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (which adds the load/unload routes); :func:`adapter_problems` checks both.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from tslightning.rollout.vllm_server.client import ServerClient, ServerError

__all__ = ["AdapterSpec", "adapter_name", "adapter_problems", "publish_adapter", "write_adapter"]

NAME_PREFIX = "tslightning-policy-v"


@dataclass(frozen=True)
class AdapterSpec:
    """The LoRA adapter a run publishes, as peft configures it (``model.lora``).

    Attributes:
        r: LoRA rank.
        alpha: LoRA scaling numerator (``lora_alpha``).
        target_modules: The adapted modules' names (HF names, e.g. ``q_proj``).
        directory: Where each version's adapter is written; every server must read it at this same path.
        base_model: θ_0's checkpoint directory (recorded in ``adapter_config.json``).
    """

    r: int
    alpha: int
    target_modules: tuple[str, ...]
    directory: Path
    base_model: str = ""


def adapter_name(version: int) -> str:
    """The served name of θ_version's adapter (what requests of that update name as their ``model``)."""
    return f"{NAME_PREFIX}{version}"


def write_adapter(spec: AdapterSpec, state: Mapping[str, torch.Tensor], version: int) -> Path:
    """Write θ_version's adapter in peft's format under ``spec.directory``; returns its directory.

    Args:
        spec: The adapter's configuration and where to write it.
        state: peft's adapter state dict (``get_peft_model_state_dict``: ``...q_proj.lora_A.weight`` names).

    Raises:
        ValueError: If ``state`` holds no LoRA weight (merged weights were given instead of the adapter).
    """
    from peft import LoraConfig
    from safetensors.torch import save_file

    if not any(".lora_A." in name for name in state):
        raise ValueError(
            f"publishing θ_{version} as a LoRA adapter, but the weights given hold no lora_A tensor "
            f"({list(state)[:3]}...): publish peft's adapter state dict (get_peft_model_state_dict)"
        )
    path = spec.directory / f"policy-v{version}"
    path.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=0.0,
        target_modules=list(spec.target_modules),
        base_model_name_or_path=spec.base_model or None,
    )
    config.save_pretrained(str(path))
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in state.items()}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def publish_adapter(url: str, path: Path, version: int, previous: int | None, timeout_s: float) -> float:
    """Serve ``path``'s adapter on ``url`` as θ_version: pause → load → set the weight version → resume → unload
    ``previous``'s adapter (see the module docstring); returns seconds.

    Raises:
        RuntimeError: naming the server and the step that failed (the server may then be paused).
    """
    start = time.perf_counter()
    server = ServerClient(url, timeout_s)
    server.pause()
    # In place: a name a previous run left loaded is replaced, not refused (the prefix cache was just cleared).
    server.load_lora_adapter(adapter_name(version), str(path))
    server.set_weight_version(version)
    served = server.weight_version()
    if served != str(version):
        raise RuntimeError(f"{url} loaded adapter {adapter_name(version)} but reports weight_version {served!r}")
    server.resume()
    if previous is not None:
        server.unload_lora_adapter(adapter_name(previous))
    return time.perf_counter() - start


def adapter_problems(url: str, rank: int, timeout_s: float = 30.0) -> list[str]:
    """What ``url`` lacks for serving this run's adapters (empty: it can), one line each: LoRA on, ranks up to
    ``rank`` (``model.lora.r``) and the runtime load route."""
    import requests

    server = ServerClient(url, timeout_s)
    try:
        config, routes = server.config(), server.openapi_routes()
    except (requests.RequestException, ServerError, ValueError, KeyError) as error:
        return [f"rollout.server_urls: {url} did not describe itself ({type(error).__name__}: {error})"]
    lora_config = config.get("lora_config")
    if lora_config is None:
        return [
            f"rollout.server_urls: {url} serves without LoRA, and a LoRA run publishes adapters: start it with "
            f"--enable-lora --max-lora-rank {rank} and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
        ]
    problems = []
    if int(lora_config.get("max_lora_rank") or 0) < rank:
        problems.append(
            f"rollout.server_urls: {url} serves LoRA ranks up to {lora_config.get('max_lora_rank')}, model.lora.r is "
            f"{rank}: start it with --max-lora-rank {rank} or more"
        )
    if "/v1/load_lora_adapter" not in routes:
        problems.append(
            f"rollout.server_urls: {url} cannot load adapters at runtime (no /v1/load_lora_adapter): start it with "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"
        )
    return problems
