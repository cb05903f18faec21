"""A CPU weight-transfer backend for vLLM's weight-sync protocol: ``tslightning_gloo``, both sides.

vLLM 0.32 moves trainer weights into a running server through its weight-transfer engines — ``init`` (rendezvous),
``start_weight_update`` → ``update_weights`` → ``finish_weight_update(weight_version)`` — but its built-in transports
(``nccl``, ``ipc``, ``sparse_nccl``, ``nccl_m2n``, ...) all need CUDA. This backend is the dense NCCL engine's twin on
gloo: the trainer opens a stateless gloo group at rank 0 (vLLM's ``stateless_init_torch_distributed_process_group``,
a TCP rendezvous, so it crosses hosts), every server worker joins it after rank 0, and each parameter is broadcast on
its own, then loaded through vLLM's layerwise reload (the same ``initialize`` / ``load_weights`` / ``finalize``
sequence ``reload_weights`` uses), so no full state dict is ever staged on either side.

The worker side is registered in vLLM's :class:`WeightTransferEngineFactory` when this module is imported. A server
imports it through its worker extension: start it with
``--worker-extension-cls tslightning.rollout.vllm_server.gloo_transfer.GlooTransferWorkerExtension`` and
``--weight-transfer-config '{"backend": "tslightning_gloo"}'`` (vLLM imports the extension's module in every worker
before loading the model). The trainer side registers in :class:`WeightTransferTrainerFactory` the same way.

This module imports vLLM: import it only where vLLM is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from tslightning.rollout.vllm_engine.worker_extension import retie_lm_head

__all__ = [
    "BACKEND",
    "GlooTrainerInitInfo",
    "GlooTrainerWeightTransferEngine",
    "GlooTransferWorkerExtension",
    "GlooWeightTransferEngine",
]

BACKEND = "tslightning_gloo"
"""The backend name in ``--weight-transfer-config`` and in both factories."""


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """What a server worker needs to join the trainer's gloo group (plain JSON over vLLM's HTTP route)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the rendezvous: it opens the group as rank 0 at ``master_address:master_port``.

    ``world_size`` is 1 (the trainer) plus the server's workers (its tensor x pipeline x data parallel size).
    """

    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 600.0


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One round: the parameters the trainer broadcasts next, in order (HF checkpoint names)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes must have one entry per parameter; got {len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)}"
            )


def open_gloo_group(address: str, port: int, rank: int, world_size: int, timeout_s: float) -> Any:
    """A gloo process group outside torch.distributed's global state (rank 0 hosts the TCP rendezvous)."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        address, port, rank, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s)
    )


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: receives each parameter by gloo broadcast from the trainer (rank 0) and loads it layerwise."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None
        self._expected: set[str] = set()
        self._loaded: set[str] = set()

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = open_gloo_group(
            init_info.master_address,
            init_info.master_port,
            worker + init_info.rank_offset,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        # A server with LoRA enabled wraps adapted layers (their weight is ``<layer>.base_layer.weight``) but loads
        # and reports checkpoint names, as vLLM's own reload_weights counts them.
        self._expected = {name.replace(".base_layer.", ".") for name, _ in self.model.named_parameters()}
        self._loaded = set()
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class then synchronizes an accelerator; a gloo broadcast has landed once its work is waited on.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        """Receive and load every parameter of the round (one ``update_weights`` call carries them all).

        A parameter this model cannot load (another name or shape) does not stop the receiving — the trainer's
        broadcasts must all be met — but fails the round once they are, as does a parameter of this model the
        trainer did not send; the layerwise reload is finalized first, so the worker can take the next update.
        """
        if self.group is None:
            raise RuntimeError("tslightning_gloo weight transfer is not initialized: call init_weight_transfer_engine")
        refused: list[str] = []
        for name, dtype_name, shape in zip(update_info.names, update_info.dtype_names, update_info.shapes, strict=True):
            weight = torch.empty(shape, dtype=getattr(torch, dtype_name))
            self.group.broadcast(weight, 0).wait()
            try:
                self._loaded |= set(self.model.load_weights([(name, weight)]) or ())
            except Exception as error:
                refused.append(f"{name} {tuple(shape)} ({type(error).__name__}: {error})")
        missing = sorted(self._expected - self._loaded)
        if refused or missing:
            self._finalize()
            raise RuntimeError(
                f"the trainer trains another architecture than this server serves: {len(refused)} parameter(s) "
                f"refused ({refused[:2]}), {len(missing)} of the server's not sent ({missing[:3]})"
            )

    def finish_weight_update(self) -> None:
        self._finalize()

    def _finalize(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        if getattr(self.model_config.hf_text_config, "tie_word_embeddings", False):
            retie_lm_head(self.model)

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side: opens the gloo group as rank 0, then each round drives ``start`` → ``update_weights`` (the
    workers' receive, run concurrently with the broadcasts it waits for) → ``finish`` through the client."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None, is_sender: bool = True):
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.group: Any = None

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> GlooTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("tslightning_gloo weight transfer requires a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        worker_info = GlooWeightTransferInitInfo(
            init_info.master_address, init_info.master_port, 1, init_info.world_size, init_info.timeout_s
        )
        # The workers block in the rendezvous inside init_weight_transfer_engine: both sides must meet at once.
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = open_gloo_group(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, init_info.timeout_s
            )
            joined.result()
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        update = GlooWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(update))
            for _, tensor in checked_pairs(self.source, meta):
                if received.done():  # the workers failed before joining this broadcast: stop instead of hanging
                    received.result()
                self.group.broadcast(tensor.detach().to("cpu").contiguous(), 0).wait()
            received.result()
        finally:
            pool.shutdown(wait=False)  # a failed broadcast leaves the RPC blocked: never wait for it here
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.group is not None:
            from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


def checked_pairs(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against the metadata the workers sized their receive buffers from."""
    count = 0
    for name, tensor in source:
        expected = meta[count] if count < len(meta) else None
        if expected is None or (name, tensor.dtype, tuple(tensor.shape)) != (
            expected.name,
            expected.dtype,
            tuple(expected.shape),
        ):
            raise ValueError(
                f"WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} at position {count}, but its "
                f"metadata() declared {expected}: both must list the same parameters in the same order"
            )
        count += 1
        yield name, tensor
    if count != len(meta):
        raise ValueError(f"WeightSource yielded {count} parameters but metadata() declared {len(meta)}")


class GlooTransferWorkerExtension:
    """A vLLM worker extension (``--worker-extension-cls``): vLLM imports its module in every worker before the model
    loads, which registers the ``tslightning_gloo`` backend there."""

    def tslightning_sampler_is_exact(self) -> bool:
        """Whether this worker's rejection sampler keeps the sampling distribution (``POST /collective_rpc``; see
        :mod:`tslightning.rollout.vllm_engine.cpu_sampling`)."""
        from tslightning.rollout.vllm_engine.cpu_sampling import sampler_is_exact

        return sampler_is_exact()


WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
