"""Published weights: one full tensor at a time in the served dtype, every pass ordered after the optimizer step."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from harness import grpo_batch

import tslightning.callbacks.weight_publisher as weight_publisher
from tslightning.callbacks import WeightPublisher
from tslightning.callbacks.published_weights import REPLICATED, PublishedWeights, full_tensors, step_completion
from tslightning.core.sources import BatchClosed
from tslightning.learner.streaming_module import OptimizerSettings, StreamingPolicyModule
from tslightning.rollout.engine import PublishReceipt, WeightStream


class _Recorder:
    """Stands in for CUDA's event and stream API, writing every call into one ordered log."""

    def __init__(self) -> None:
        self.log: list[str] = []
        recorder = self

        class Event:
            def record(self, stream) -> None:
                recorder.log.append(f"event recorded on {stream}")

            def synchronize(self) -> None:
                recorder.log.append("host waits for the event")

        self.Event = Event

    def current_stream(self, device) -> str:
        return f"the learner stream of {device}"


class _StreamingEngine:
    """Receives each publication tensor by tensor, once per server, logging every tensor as it arrives."""

    serving_dtype = torch.bfloat16
    accepts_weight_stream = True

    def __init__(self, log: list[str], servers: int = 1) -> None:
        self.log, self.servers, self.policy_version, self.received = log, servers, 0, []

    def publish(self, weights: WeightStream, policy_version: int) -> PublishReceipt:
        self.log.append(f"publish θ_{policy_version}")
        for _server in range(self.servers):
            for name, tensor in weights:
                self.log.append(f"send {name}")
                self.received.append((name, tensor))
        self.policy_version = policy_version
        return PublishReceipt(policy_version, self.servers, 0.0)


def test_publication_waits_for_the_optimizer_step_before_its_first_send(make_policy, vocab_size, monkeypatch):
    """On a GPU the sender may read θ on its own stream: the step's kernels, queued on the learner's stream, must
    have finished first. The event is recorded after the step was queued and waited for before any tensor is sent,
    again before every server's pass."""
    cuda = _Recorder()
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(weight_publisher, "_device_of", lambda policy: torch.device("cuda", 0))
    engine = _StreamingEngine(cuda.log, servers=2)
    module = StreamingPolicyModule(make_policy(), optimizer=OptimizerSettings(lr=1e-3))
    optimizer = module.configure_optimizers()
    optimizer.register_step_post_hook(lambda *args: cuda.log.append("optimizer step queued"))
    batch = grpo_batch(vocab_size)
    for item in batch.stream():
        module.ingest(item)
    module.barrier(optimizer)
    WeightPublisher(engine).on_train_batch_end(L.Fabric(accelerator="cpu", devices=1), module, None, BatchClosed(0), 0)

    log = cuda.log
    sends = [i for i, entry in enumerate(log) if entry.startswith("send")]
    names = list(module.policy.state_dict())
    assert log[: 3 + 1] == [
        "optimizer step queued",
        "event recorded on the learner stream of cuda:0",
        "publish θ_1",
        "host waits for the event",
    ]
    assert log[sends[0] - 1] == "host waits for the event" and len(sends) == 2 * len(names)
    second_pass = sends[len(names)]
    assert log[second_pass - 1] == "host waits for the event"  # the second server's pass waits too
    assert [name for name, _ in engine.received] == names + names


def test_each_tensor_arrives_in_the_served_dtype_with_the_learner_values(make_policy):
    policy = make_policy(torch.float32)
    stream = PublishedWeights(policy, REPLICATED, torch.bfloat16)
    assert [m.name for m in stream.metadata()] == list(policy.state_dict())
    assert all(m.dtype == torch.bfloat16 for m in stream.metadata())
    received = dict(stream)
    for name, tensor in policy.state_dict().items():
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], tensor.to(torch.bfloat16))
    assert stream.passes == 1
    unchanged = dict(PublishedWeights(policy, REPLICATED, None))
    assert all(unchanged[n].data_ptr() == t.data_ptr() for n, t in policy.state_dict().items())  # no copy at all


def test_the_stream_is_lazy_one_tensor_at_a_time(make_policy, monkeypatch):
    """Nothing is produced before the engine asks, and each tensor only when it asks for it."""
    produced: list[str] = []
    real = full_tensors

    def counting(policy, placement):
        for name, tensor in real(policy, placement):
            produced.append(name)
            yield name, tensor

    import tslightning.callbacks.published_weights as published_weights

    monkeypatch.setattr(published_weights, "full_tensors", counting)
    stream = PublishedWeights(make_policy(), REPLICATED, torch.bfloat16)
    assert produced == [] and len(stream) > 2
    pairs = iter(stream)
    first = next(pairs)
    assert produced == [first[0]]
    next(pairs)
    assert len(produced) == 2


def test_step_completion_is_a_no_op_on_a_cpu():
    assert step_completion(torch.device("cpu"))() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_engine_that_serves_adapters_still_gets_a_small_state_dict(make_policy, dtype):
    from peft import LoraConfig, get_peft_model

    policy = get_peft_model(make_policy(), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    engine = _StreamingEngine([])
    engine.publishes_adapter, engine.serving_dtype = True, dtype
    weights = weight_publisher.publication_weights(policy, engine, REPLICATED)
    assert all(".lora_" in name for name in weights.names())  # the adapter alone, in peft's saved names
