"""`fit`'s ``vllm_server`` rollout engine: on the user's servers (``rollout.server_urls``) or on replicas the Ray
launcher starts, and — with several learner ranks — shared by them: global rank 0 starts the servers once and
publishes, every other rank connects to the same servers and follows its publications (README: Rollout servers).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from tslightning.distributed.collectives import control_broadcast, distributed
from tslightning.loop.settings import RolloutSettings

__all__ = ["adapter_spec", "replica_server_args", "start_vllm_server"]


def start_vllm_server(rollout: RolloutSettings, policy_dir: Path, dtype: str, context: int, lora=None):
    """This learner rank's ``vllm_server`` engine serving ``policy_dir`` (θ_0) in ``dtype`` for ``context`` tokens;
    with ``lora`` (``model.lora``) it publishes the adapter. Several ranks: see :func:`_share_servers`."""
    adapter = adapter_spec(lora, rollout, policy_dir)
    if distributed():
        return _share_servers(rollout, policy_dir, dtype, context, adapter)
    return _start_engine(rollout, policy_dir, dtype, context, adapter)


def _share_servers(rollout: RolloutSettings, policy_dir: Path, dtype: str, context: int, adapter=None):
    """Several learner ranks on the same servers: global rank 0 starts the publishing engine (launching the servers
    once, with ``rollout.launcher ray``) and publishes θ_0; its servers' URLs and what they serve are then broadcast,
    and every other rank connects a follower engine to those URLs (no rank checks a server before θ_0 is served).

    Raises:
        ValueError: rank 0's own error there; on the other ranks, one naming rank 0's failure.
    """
    from tslightning.rollout.vllm_server.engine import VLLMServerEngine

    rank, engine, error = dist.get_rank(), None, None
    if rank == 0:
        try:
            engine = _start_engine(rollout, policy_dir, dtype, context, adapter, sharing="publisher")
        except Exception as raised:
            error = raised
    outcome = None  # the other ranks' value: ignored by the broadcast
    if rank == 0:
        outcome = (engine.urls, engine.served()) if engine is not None else f"{type(error).__name__}: {error}"
    started = control_broadcast(outcome)
    if error is not None:
        raise error
    if isinstance(started, str):
        raise ValueError(f"rollout: global rank 0 could not start the vllm_server engine ({started})")
    if rank == 0:
        return engine
    urls, served = started
    return VLLMServerEngine(
        urls,
        policy_dir,
        transport=rollout.server_transport,
        dtype=dtype,
        context_tokens=context,
        policy_version=served.policy_version,
        timeout_s=rollout.server_timeout_s,
        adapter=adapter,
        sharing="follower",
        rank=rank,
        speculative=rollout.speculative,
    )


def _start_engine(
    rollout: RolloutSettings, policy_dir: Path, dtype: str, context: int, adapter=None, sharing: str = "none"
):
    """The ``vllm_server`` engine on ``rollout.server_urls``, or on replicas the Ray launcher starts first (with
    LoRA at runtime when ``adapter``, a LoRA run's :class:`~tslightning.rollout.vllm_server.lora_adapter.AdapterSpec`);
    ``sharing``: the engine's (``publisher`` on global rank 0 of several)."""
    from tslightning.rollout.vllm_server.engine import VLLMServerEngine

    replicas = None
    if rollout.launcher == "ray":
        from tslightning.rollout.vllm_server.ray_launcher import RayReplicas

        replicas = RayReplicas(
            rollout.ray,
            policy_dir,
            policy_dir.parent / "replicas",
            transport=rollout.server_transport,
            dtype=dtype,
            max_model_len=rollout.vllm.max_model_len or context,
            extra=replica_server_args(rollout),
            lora_rank=adapter.r if adapter is not None else None,
            speculative=rollout.speculative,
        )
    try:
        return VLLMServerEngine(
            replicas.urls if replicas is not None else rollout.server_urls or [],
            policy_dir,
            transport=rollout.server_transport,
            dtype=dtype,
            context_tokens=context,
            timeout_s=rollout.server_timeout_s,
            replicas=replicas,
            adapter=adapter,
            sharing=sharing,
            speculative=rollout.speculative,
        )
    except BaseException:
        if replicas is not None:
            replicas.close()
        raise


def replica_server_args(rollout: RolloutSettings, gpus: float | None = None) -> list[str]:
    """The ``api_server`` flags of each launched server from ``rollout.vllm`` (``rollout.ray.server_args`` follow);
    ``gpus``: the server's Ray GPUs (``None``: a replica's ``rollout.ray.num_gpus``)."""
    vllm = rollout.vllm
    args = ["--tensor-parallel-size", str(vllm.tensor_parallel_size)]
    if (rollout.ray.num_gpus if gpus is None else gpus) > 0:
        args += ["--gpu-memory-utilization", str(vllm.gpu_memory_utilization)]
    if vllm.enforce_eager:
        args.append("--enforce-eager")
    return args


def adapter_spec(lora, rollout: RolloutSettings, policy_dir: Path):
    """Where and how a LoRA run's adapters are published to vLLM servers (``None``: not a LoRA run)."""
    if lora is None:
        return None
    from tslightning.rollout.vllm_server.lora_adapter import AdapterSpec

    directory = Path(rollout.server_adapter_dir) if rollout.server_adapter_dir else policy_dir.parent / "adapters"
    return AdapterSpec(lora.r, lora.alpha, tuple(lora.target_modules), directory.resolve(), str(policy_dir))
