"""Publication of θ_k into running vLLM servers with vLLM's own weight-sync protocol (App. D.2).

Per server and per publication: ``POST /pause?mode=wait`` (requests already running finish at θ_{k-1}, nothing new
is scheduled, the prefix cache is cleared) → the transfer, driven by vLLM's trainer-side weight-transfer engine
(``start_weight_update`` → ``update_weights`` with the broadcast → ``finish_weight_update`` with ``weight_version``
``"k"``) → ``GET /weight_info`` must answer ``"k"`` → ``POST /resume``. Every generation then reports the version that
sampled its tokens (vLLM's per-token ``weight_versions``), which the server engine checks.

Transports, behind one interface (:class:`ServerTransport`):

- ``gloo`` (CPU, any host): :mod:`tslightning.rollout.vllm_server.gloo_transfer`, servers started with
  ``--weight-transfer-config '{"backend": "tslightning_gloo"}'`` and its worker extension.
- ``nccl`` (GPUs): vLLM's own ``NCCLTrainerWeightTransferEngine`` (servers started with
  ``--weight-transfer-config '{"backend": "nccl"}'``): a weight-update group between the learner (rank 0, on its
  current CUDA device) and the server's workers, packed into buckets and streamed parameter by parameter.

Both are set up once per server (the rendezvous) and then replay a :class:`PublishedWeights` source each round, so
the learner never stages a copy of the state dict. The servers' routes need ``VLLM_SERVER_DEV_MODE=1``. This module
imports vLLM (its trainer-side engines): import it only where vLLM is installed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import requests
import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from tslightning.rollout.engine import WeightStream, weight_stream
from tslightning.rollout.vllm_server.client import ServerClient, ServerError

__all__ = [
    "PublishedWeights",
    "ServerTransport",
    "VersionedSyncClient",
    "free_port",
    "join_transfer_groups",
    "local_address_towards",
]

Transport = Literal["gloo", "nccl"]


class PublishedWeights(WeightSource):
    """vLLM's ``WeightSource`` over the weights being published (HF names): :meth:`set` them, then send.

    It lists the stream's metadata and yields its tensors as the stream produces them (one at a time, never a copy);
    :meth:`set` ``{}`` after the round drops the stream.
    """

    def __init__(self) -> None:
        self.state: WeightStream = WeightStream.of({})

    def set(self, state: Mapping[str, torch.Tensor] | WeightStream) -> None:
        self.state = weight_stream(state)

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(meta.name, meta.dtype, tuple(meta.shape)) for meta in self.state.metadata()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.state


class VersionedSyncClient:
    """vLLM's ``HTTPVLLMWeightSyncClient`` for one server, whose ``finish_weight_update`` stamps :attr:`version`.

    vLLM's trainer engines call ``finish_weight_update()`` without a version; the publication sets the version first,
    so the server commits the new weights and their version in one call. HTTP errors carry the server's answer.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.version: int | None = None
        self._client = HTTPVLLMWeightSyncClient(url, timeout=timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(self._client.init_weight_transfer_engine, init_info)

    def start_weight_update(self) -> None:
        self._call(self._client.start_weight_update)

    def update_weights(self, update_info: Any) -> None:
        self._call(self._client.update_weights, update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else None if self.version is None else str(self.version)
        self._call(self._client.finish_weight_update, version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call(self._client.shutdown_weight_transfer_engine)

    def _call(self, method: Callable, *args: Any) -> None:
        try:
            method(*args)
        except requests.HTTPError as error:  # vLLM's client raises for a status: the same policy as our routes'
            if error.response is None:
                raise RuntimeError(f"{self.url}: {error}") from None
            answer = error.response
            method = getattr(answer.request, "method", None) or "POST"
            raise ServerError(method, answer.url, answer.status_code, answer.text) from None


@dataclass
class ServerTransport:
    """The trainer side of one server's weight transfer, rendezvoused once and replayed at every publication.

    Args:
        url: The server's base URL.
        transport: ``gloo`` or ``nccl`` (see the module docstring).
        world_size: 1 (the learner) + the server's workers (``GET /get_world_size``).
        address: This host's address as the server sees it (where the learner hosts the rendezvous).
        timeout_s: Seconds each HTTP call and the rendezvous may take.
    """

    url: str
    transport: Transport
    world_size: int
    address: str
    timeout_s: float

    def __post_init__(self) -> None:
        self.client = VersionedSyncClient(self.url, self.timeout_s)
        self.weights = PublishedWeights()
        self.engine = _trainer_engine(self.transport, self.client, self.weights, self.address, self.world_size)

    def publish(self, state: Mapping[str, torch.Tensor] | WeightStream, version: int) -> float:
        """Pause (drain) → transfer → finish with ``version`` → check the server's version → resume; returns seconds.

        Raises:
            RuntimeError: naming the server and the step that failed (the server may then hold partial weights).
        """
        start = time.perf_counter()
        server = ServerClient(self.url, self.timeout_s)
        server.pause()
        self.weights.set(state)
        self.client.version = version
        try:
            self.engine.send_weights()
        finally:
            self.weights.set({})
        served = server.weight_version()
        if served != str(version):
            raise RuntimeError(f"{self.url} finished the update but reports weight_version {served!r}, not {version}")
        server.resume()
        return time.perf_counter() - start

    def close(self) -> None:
        """Leave the transfer group (the server keeps serving; a new transport can rendezvous later)."""
        try:
            self.client.shutdown_weight_transfer_engine()
        finally:
            self.engine.shutdown()


def _trainer_engine(transport: Transport, client: Any, source: Any, address: str, world_size: int) -> Any:
    port = free_port(address)
    if transport == "gloo":
        from tslightning.rollout.vllm_server.gloo_transfer import GlooTrainerInitInfo

        init: Any = GlooTrainerInitInfo(master_address=address, master_port=port, world_size=world_size, rank=0)
    else:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        init = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world_size, rank=0)
    return WeightTransferTrainerFactory.trainer_init(init, client=client, source=source)


def free_port(address: str) -> int:
    """A TCP port free on ``address`` now (the rendezvous binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host:port``: where a server reaches the learner's rendezvous."""
    with socket.create_connection((host, port), timeout=10) as connection:
        return connection.getsockname()[0]


def join_transfer_groups(urls: Sequence[str], transport: Transport, timeout_s: float) -> list[ServerTransport]:
    """One weight-transfer rendezvous per server (the learner is rank 0 of each group)."""
    transports: list[ServerTransport] = []
    try:
        for url in urls:
            world = ServerClient(url, timeout_s).world_size()
            host_port = url.split("://", 1)[1].split("/", 1)[0]
            host, port = host_port.rsplit(":", 1)
            address = local_address_towards(host, int(port))
            transports.append(ServerTransport(url, transport, 1 + world, address, timeout_s))
    except BaseException:
        for joined in transports:
            joined.close()
        raise
    return transports
