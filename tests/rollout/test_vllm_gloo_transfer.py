"""The ``tslightning_gloo`` weight-transfer backend, both sides in one process over a real gloo group: the worker
side as a server's worker drives it (the client calls what vLLM's HTTP routes call), a stand-in model recording what
it loads. The real server round trip is in test_vllm_server_engine.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

import vllm.model_executor.model_loader.reload as reload  # noqa: E402
from vllm.config.weight_transfer import WeightTransferConfig  # noqa: E402
from vllm.distributed.weight_transfer.base import ParamMeta  # noqa: E402
from vllm.distributed.weight_transfer.factory import (  # noqa: E402
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

from tslightning.rollout.vllm_server.gloo_transfer import BACKEND, GlooTrainerInitInfo, checked_pairs  # noqa: E402
from tslightning.rollout.vllm_server.publication import PublishedWeights, free_port  # noqa: E402


class StandInModel(torch.nn.Module):
    """Two parameters; ``load_weights`` copies known names (vLLM's contract: returns the names it loaded)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3, 2))
        self.b = torch.nn.Parameter(torch.zeros(4))
        self.loaded: list[str] = []

    def load_weights(self, weights):
        names = set()
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)  # AttributeError for an unknown name, like a KeyError in vLLM
            names.add(name)
            self.loaded.append(name)
        return names


class InProcessServer:
    """What vLLM's routes call on the worker (``Worker.init_weight_transfer_engine`` ... ``finish_weight_update``)."""

    def __init__(self, worker) -> None:
        self.worker, self.calls = worker, []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")
        self.worker.init_transfer_engine(self.worker.parse_init_info(init_info))

    def start_weight_update(self):
        self.calls.append("start")
        self.worker.start_weight_update()

    def update_weights(self, update_info):
        self.calls.append("update")
        self.worker.update_weights(update_info)

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))
        self.worker.finish_weight_update()


@pytest.fixture
def sides(monkeypatch):
    """(trainer engine, its source, the stand-in model, the call log) joined in one gloo group."""
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: None)
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: None)
    model = StandInModel()
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(tie_word_embeddings=False)),
    )
    worker = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend=BACKEND), vllm_config, torch.device("cpu"), model
    )
    server, source = InProcessServer(worker), PublishedWeights()
    port = free_port("127.0.0.1")
    info = GlooTrainerInitInfo(master_address="127.0.0.1", master_port=port, world_size=2, timeout_s=60, rank=0)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=server, source=source)
    yield trainer, source, model, server.calls
    trainer.shutdown()
    worker.shutdown()


def test_each_parameter_arrives_exactly_through_the_protocol(sides):
    trainer, source, model, calls = sides
    state = {"a": torch.randn(3, 2), "b": torch.randn(4, dtype=torch.float64)}
    source.set(state)
    trainer.send_weights()
    assert calls == ["init", "start", "update", ("finish", None)]
    assert torch.equal(model.a.data, state["a"]) and torch.equal(model.b.data, state["b"].float())
    assert model.loaded == ["a", "b"]  # streamed one parameter at a time, in the source's order


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"a": torch.ones(3, 2)}, r"1 of the server's not sent \(\['b'\]\)"),
        ({"a": torch.ones(3, 2), "b": torch.ones(4), "c": torch.ones(1)}, r"1 parameter\(s\) refused \(\[.c \(1,\)"),
        ({"a": torch.ones(2, 3), "b": torch.ones(4)}, r"refused \(\[.a \(2, 3\)"),
    ],
)
def test_another_architecture_fails_the_round_after_every_broadcast(sides, state, message):
    """Missing, unknown or reshaped parameters: every broadcast is still met (no hang), then the round fails."""
    trainer, source, _, calls = sides
    source.set(state)
    with pytest.raises(RuntimeError, match=rf"another architecture than this server serves: .*{message}"):
        trainer.send_weights()
    assert calls == ["init", "start", "update"]  # never finished: the server does not commit the version


def test_a_source_that_contradicts_its_metadata_is_refused():
    """What the workers sized their buffers from must be what is broadcast (checked before each broadcast)."""

    class Lying(PublishedWeights):
        def __iter__(self):
            yield "b", torch.zeros(4)

    lying = Lying()
    lying.set({"a": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"yielded 'b' .* at position 0, but its metadata\(\) declared"):
        list(checked_pairs(lying, lying.metadata()))
    honest = PublishedWeights()
    honest.set({"a": torch.zeros(4)})
    declared = [*honest.metadata(), ParamMeta("b", torch.float32, (4,))]
    with pytest.raises(ValueError, match=r"yielded 1 parameters but metadata\(\) declared 2"):
        list(checked_pairs(honest, declared))
