"""WeightPublisher: θ_{k+1} published at version k+1 after each update and acknowledged; LoRA merged; real engine."""

from __future__ import annotations

import copy
import threading
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from harness import HOSTS, FakeEngine, MemoryLogger, PlainModule, fit_plain, grpo_batch, plain_batches, run_updates
from peft import LoraConfig, get_peft_model

from tslightning.callbacks import WeightPublisher
from tslightning.callbacks.weight_publisher import publishable_state_dict
from tslightning.core.sources import BatchClosed
from tslightning.learner.streaming_module import OptimizerSettings, StreamingPolicyModule
from tslightning.models.tiny_model import load_tiny_model, save_tiny_model
from tslightning.rollout.engine import GenerationRequest, PublishReceipt, RolloutEngineError
from tslightning.rollout.hf.engine import HFRolloutEngine

ENGINE_ATOL = 2e-5  # float32: the engine's cached decode vs one full forward in the learner


def stub_module(version: int = 1) -> SimpleNamespace:
    """What the hook reads from a module: its policy, new version and timings."""
    return SimpleNamespace(policy=torch.nn.Linear(2, 2), policy_version=version, update_timings={})


@pytest.mark.parametrize("host", HOSTS)
def test_each_update_publishes_the_new_weights_at_the_new_version(make_policy, vocab_size, host, tmp_path):
    engine, logger = FakeEngine(), MemoryLogger()
    publisher = WeightPublisher(engine)
    module = StreamingPolicyModule(make_policy(), optimizer=OptimizerSettings(lr=1e-3))
    theta0 = {n: t.clone() for n, t in module.policy.state_dict().items()}
    run_updates(host, module, [grpo_batch(vocab_size, 0), grpo_batch(vocab_size, 1)], [publisher], logger, tmp_path)

    assert [version for version, _ in engine.published] == [1, 2] and module.policy_version == 2
    (_, first), (_, last) = engine.published
    final = module.policy.state_dict()
    assert last.keys() == final.keys() == theta0.keys()
    assert all(torch.equal(last[n], final[n]) for n in final)
    assert not torch.equal(first["model.embed_tokens.weight"], theta0["model.embed_tokens.weight"])
    assert not torch.equal(first["model.embed_tokens.weight"], last["model.embed_tokens.weight"])
    assert module.update_timings["publication_s"] >= 0.0
    timings = logger.having("timing_s/update_weights")
    assert [step for step, _ in timings] == [0, 1]
    assert timings[-1][1]["timing_s/update_weights"] == module.update_timings["publication_s"]
    assert publisher.state_dict() == {"published_version": 2, "publications": 2}
    restored = WeightPublisher(FakeEngine())
    restored.load_state_dict(publisher.state_dict())
    assert restored.state_dict() == publisher.state_dict()
    assert restored.state_key == publisher.state_key == "WeightPublisher{'engine': 'FakeEngine'}"


def test_receipt_for_another_version_is_an_error():
    publisher, module = WeightPublisher(FakeEngine(version_offset=1)), stub_module(version=1)
    with pytest.raises(RolloutEngineError, match="published θ_1 but the engine acknowledged version 2"):
        publisher.on_train_batch_end(L.Fabric(accelerator="cpu", devices=1), module, None, BatchClosed(0), 0)
    assert publisher.published_version is None and "publication_s" not in module.update_timings


def test_missing_acknowledgement_times_out():
    hold = threading.Event()
    publisher, module = WeightPublisher(FakeEngine(hold=hold), timeout_s=0.05), stub_module(version=1)
    try:
        with pytest.raises(RolloutEngineError, match=r"did not acknowledge θ_1 within timeout_s=0.05 s"):
            publisher.on_train_batch_end(L.Fabric(accelerator="cpu", devices=1), module, None, BatchClosed(0), 0)
    finally:
        hold.set()
    assert publisher.published_version is None


def test_only_batch_closed_ends_an_update():
    engine = FakeEngine()
    publisher = WeightPublisher(engine)
    publisher.on_train_batch_end(L.Fabric(accelerator="cpu", devices=1), stub_module(), None, object(), 0)
    assert engine.published == []


def test_lora_policy_publishes_merged_weights_and_keeps_its_adapters(make_policy, vocab_size):
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    policy = get_peft_model(make_policy(), config)
    adapters = {n: p.detach().clone() for n, p in policy.named_parameters()}
    weights = publishable_state_dict(policy)

    served, base = make_policy(), make_policy()
    assert weights.keys() == served.state_dict().keys()
    served.load_state_dict(weights)
    ids = torch.randint(0, vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = policy(input_ids=ids).logits
        torch.testing.assert_close(served(input_ids=ids).logits, expected, atol=1e-12, rtol=0)
        assert (base(input_ids=ids).logits - expected).abs().max() > 1e-3  # the adapters do change the model
    assert all(torch.equal(p, adapters[n]) for n, p in policy.named_parameters())


def test_an_engine_serving_adapters_is_published_the_adapter_alone(make_policy):
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    policy = get_peft_model(make_policy(), config)
    engine = FakeEngine()
    engine.publishes_adapter = True
    module = SimpleNamespace(policy=policy, policy_version=1, update_timings={})
    WeightPublisher(engine).on_train_batch_end(L.Fabric(accelerator="cpu", devices=1), module, None, BatchClosed(0), 0)

    ((version, published),) = engine.published
    adapters = {n.replace(".default", ""): p for n, p in policy.named_parameters() if "lora_" in n}
    assert version == 1 and set(published) == set(adapters)  # peft's saved names: no base weight, nothing merged
    assert all(torch.equal(published[n], adapters[n]) for n in published)


def test_an_engine_serving_adapters_refuses_a_policy_without_one():
    engine = FakeEngine()
    engine.publishes_adapter = True
    with pytest.raises(ValueError, match="set model.lora"):
        WeightPublisher(engine).on_train_batch_end(
            L.Fabric(accelerator="cpu", devices=1), stub_module(), None, BatchClosed(0), 0
        )
    assert engine.published == []


def rescore(model: torch.nn.Module, prompt: tuple[int, ...], token_ids: tuple[int, ...]) -> torch.Tensor:
    """log π(sampled id) from one full forward over prompt + sampled ids, as the learner computes it."""
    ids = torch.tensor([list(prompt) + list(token_ids)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids)[:, None])[:, 0]


def test_hf_engine_serves_the_updated_policy(tmp_path):
    path = save_tiny_model(tmp_path / "tiny")
    policy, _ = load_tiny_model(path)
    theta0_policy = copy.deepcopy(policy)
    batch = grpo_batch(policy.config.vocab_size)
    module = StreamingPolicyModule(policy, optimizer=OptimizerSettings(lr=1e-2))
    source = batch.items[0]
    prompt = tuple(source.token_ids[: source.prompt_length].tolist())
    with HFRolloutEngine(path, replicas=1, publish_timeout=60) as engine:
        publisher = WeightPublisher(engine, timeout_s=60)
        run_updates("fabric", module, [batch], [publisher], MemoryLogger(), tmp_path)
        assert engine.policy_version == 1 == publisher.published_version
        (generation,) = engine.generate([GenerationRequest("probe", prompt, 8, seed=5)], timeout=60)
    assert generation.policy_version == 1
    served = torch.tensor(generation.logprobs)
    torch.testing.assert_close(served, rescore(policy, prompt, generation.token_ids), atol=ENGINE_ATOL, rtol=0)
    assert (served - rescore(theta0_policy, prompt, generation.token_ids)).abs().max() > 1e-3


def test_every_rank_publication_on_one_rank_publishes_and_raises_its_own_failure():
    """``every_rank`` (rank-aware rollout) on one process; the two-rank case runs in test_multirank.py."""
    fabric = L.Fabric(accelerator="cpu", devices=1)
    engine = FakeEngine()
    WeightPublisher(engine, every_rank=True).on_train_batch_end(fabric, stub_module(1), None, BatchClosed(0), 0)
    assert [version for version, _ in engine.published] == [1]
    failing = WeightPublisher(FakeEngine(version_offset=1), every_rank=True)
    with pytest.raises(RolloutEngineError, match="acknowledged version 3"):
        failing.on_train_batch_end(fabric, stub_module(2), None, BatchClosed(1), 1)


class _StateDictEngine:
    """Another project's engine, written against ``publish(state_dict, policy_version)``: its replica loads the
    state dict with ``load_state_dict`` (which refuses anything that is not a mapping)."""

    def __init__(self) -> None:
        self.replica = torch.nn.Linear(4, 1, dtype=torch.float64)
        self.policy_version, self.versions = 0, []

    def publish(self, state_dict, policy_version: int) -> PublishReceipt:
        self.replica.load_state_dict(state_dict)
        self.policy_version = policy_version
        self.versions.append(policy_version)
        return PublishReceipt(policy_version, replicas=1, seconds=0.0)


def test_an_engine_that_loads_a_state_dict_serves_each_update_under_a_plain_trainer(tmp_path):
    """A plain ``Trainer`` fitting a module that is not ours: each optimizer step is an update, and an engine that is
    not written for tslightning's weight streams is handed a state dict it can ``load_state_dict``."""
    engine = _StateDictEngine()
    module = PlainModule()
    fit_plain(module, plain_batches(3), [WeightPublisher(engine, policy=lambda m: m.layer)], tmp_path)
    assert engine.versions == [1, 2, 3]
    for name, tensor in module.layer.state_dict().items():
        assert torch.equal(engine.replica.state_dict()[name], tensor)  # it serves the trained θ_3
