"""Exactness: the streamed update equals the batch-synchronous one and the paper's equations (Sec. 3.4, App. G)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from reference import grpo_direction, opd_direction

from tslightning.core.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.objectives.advantages import AdvantageEstimator

FLOAT64_TOLERANCE = 1e-10
FLOAT32_TOLERANCE = 1e-5
MODEL_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

shapes = st.builds(
    WorkloadShape,
    num_groups=st.integers(1, 4),
    group_size=st.integers(2, 5),
    max_turns=st.integers(1, 3),
    action_tokens=st.tuples(st.integers(1, 4), st.integers(4, 12)),
    observation_tokens=st.tuples(st.integers(1, 4), st.integers(4, 16)),
    uniform_groups=st.integers(0, 1),
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run_update(policy, batch: ReplayBatch, schedule: str, **module_kwargs) -> torch.Tensor:
    """Replay ``batch`` through one update and return the pre-clip batch direction g_k."""
    module = StreamingPolicyModule(policy, objective=batch.plan.objective, schedule=schedule, **module_kwargs)
    optimizer = module.configure_optimizers()
    for item in batch.stream():
        module.ingest(item)
    module.barrier(optimizer)
    assert module.num_optimizer_steps == 1
    return module.last_direction


@MODEL_SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), estimator=st.sampled_from(list(AdvantageEstimator)))
def test_grpo_streamed_equals_sync_and_reference_float64(make_policy, vocab_size, shape, seed, estimator):
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(seed), shape)
    streamed_order = batch.reordered(torch.Generator().manual_seed(seed + 1))
    reference = grpo_direction(make_policy(), batch, estimator.value)
    sync = run_update(make_policy(), batch, "sync", advantage=estimator)
    streamed = run_update(make_policy(), streamed_order, "thundersync", advantage=estimator)
    if not bool(reference.any()):  # every group drew uniform rewards: exactly zero, not a rounding residue
        assert torch.equal(streamed, torch.zeros_like(streamed)) and torch.equal(sync, torch.zeros_like(sync))
        return
    assert rel_err(streamed, sync) <= FLOAT64_TOLERANCE
    assert rel_err(streamed, reference) <= FLOAT64_TOLERANCE
    assert rel_err(sync, reference) <= FLOAT64_TOLERANCE


@MODEL_SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_opd_streamed_equals_sync_and_reference_float64(make_policy, teacher64, vocab_size, shape, seed):
    batch = synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(seed), teacher64, shape)
    streamed_order = batch.reordered(torch.Generator().manual_seed(seed + 1))
    reference = opd_direction(make_policy(), batch)
    sync = run_update(make_policy(), batch, "sync")
    streamed = run_update(make_policy(), streamed_order, "thundersync")
    assert rel_err(streamed, sync) <= FLOAT64_TOLERANCE
    assert rel_err(streamed, reference) <= FLOAT64_TOLERANCE
    assert rel_err(sync, reference) <= FLOAT64_TOLERANCE


def test_streaming_really_reorders(vocab_size):
    """Guard for the tests above: reordering changes arrival order but keeps every dependency."""
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(0), WorkloadShape(num_groups=4))
    orders = {tuple(id(i) for i in batch.reordered(torch.Generator().manual_seed(s)).items) for s in range(5)}
    assert len(orders) == 5
    for s in range(5):
        seen: dict[str, int] = {}
        for item in batch.reordered(torch.Generator().manual_seed(s)).items:
            kind = type(item).__name__
            if kind == "TrajectorySource":
                seen[item.group_id] = seen.get(item.group_id, 0) + 1
            elif kind == "GroupClosed":
                assert seen[item.group_id] == batch.plan.group_sizes[item.group_id]


def _lora(policy):
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )  # random B, so every adapter tensor gets a non-zero gradient
    torch.manual_seed(7)
    return get_peft_model(policy, config)


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_lora_streamed_equals_sync_float64(make_policy, teacher64, vocab_size, objective):
    gen = torch.Generator().manual_seed(3)
    batch = (
        synthetic_grpo_batch(vocab_size, 0, gen)
        if objective == "grpo"
        else synthetic_opd_batch(vocab_size, 0, gen, teacher64)
    )
    lora_policy = _lora(make_policy())
    base_before = {n: p.detach().clone() for n, p in lora_policy.named_parameters() if not p.requires_grad}
    adapter_numel = sum(p.numel() for n, p in lora_policy.named_parameters() if "lora_" in n)
    module = StreamingPolicyModule(lora_policy, objective=objective, optimizer=None)
    assert module.layout.numel == adapter_numel  # statistics sized to the adapter, not the model
    streamed = run_update(lora_policy, batch.reordered(torch.Generator().manual_seed(4)), "thundersync")
    sync = run_update(_lora(make_policy()), batch, "sync")
    reference = (grpo_direction if objective == "grpo" else opd_direction)(
        _lora(make_policy()), batch, **({} if objective == "opd" else {"estimator": "grpo"})
    )
    assert rel_err(streamed, sync) <= FLOAT64_TOLERANCE
    assert rel_err(streamed, reference) <= FLOAT64_TOLERANCE
    assert all(t.abs().sum() > 0 for t in streamed.split([p.numel() for p in module.layout.parameters]))
    after = dict(lora_policy.named_parameters())
    assert all(torch.equal(after[n], before) for n, before in base_before.items())  # base weights frozen


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_float32_streamed_equals_sync(make_policy, teacher64, vocab_size, objective):
    gen = torch.Generator().manual_seed(11)
    batch = (
        synthetic_grpo_batch(vocab_size, 0, gen)
        if objective == "grpo"
        else synthetic_opd_batch(vocab_size, 0, gen, teacher64)
    )
    sync = run_update(make_policy(torch.float32), batch, "sync")
    streamed = run_update(make_policy(torch.float32), batch.reordered(torch.Generator().manual_seed(12)), "thundersync")
    assert sync.dtype == torch.float32
    assert rel_err(streamed.double(), sync.double()) <= FLOAT32_TOLERANCE


def test_parameters_equal_after_several_updates_float64(make_policy, vocab_size):
    """Sync and thundersync from the same θ_0 over 4 logical batches: the same parameters (Eq. 30 gap ~0)."""
    sync_module = StreamingPolicyModule(make_policy(), schedule="sync")
    stream_module = StreamingPolicyModule(make_policy(), schedule="thundersync", group_admission_cap=1)
    sync_opt, stream_opt = sync_module.configure_optimizers(), stream_module.configure_optimizers()
    theta0 = sync_module.layout.values()
    for k in range(4):
        batch = synthetic_grpo_batch(vocab_size, k, torch.Generator().manual_seed(100 + k))
        for item in batch.stream():
            sync_module.ingest(item)
        for item in batch.reordered(torch.Generator().manual_seed(200 + k)).stream():
            stream_module.ingest(item)
        sync_module.barrier(sync_opt)
        stream_module.barrier(stream_opt)
    sync_theta, stream_theta = sync_module.layout.values(), stream_module.layout.values()
    moved = (sync_theta - theta0).norm()
    assert moved > 0
    assert float((stream_theta - sync_theta).norm() / moved) <= FLOAT64_TOLERANCE
    assert sync_module.policy_version == stream_module.policy_version == 4


@pytest.mark.parametrize("cap", [1, 2])
def test_admission_cap_bounds_memory_and_keeps_exactness(make_policy, vocab_size, cap):
    """App. D.3: with cap k, statistics + batch accumulator stay within (2k+1)·P values; the update is unchanged."""
    shape = WorkloadShape(num_groups=5, group_size=3, max_turns=2)
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(5), shape)
    interleaved = batch.reordered(torch.Generator().manual_seed(6))
    capped = StreamingPolicyModule(make_policy(), group_admission_cap=cap)
    uncapped = StreamingPolicyModule(make_policy())
    results = []
    for module in (capped, uncapped):
        optimizer = module.configure_optimizers()
        waiting = []
        for item in interleaved.stream():
            module.ingest(item)
            waiting.append(module.admission.num_waiting)
        results.append(module.barrier(optimizer))
    numel = capped.layout.numel
    assert results[0].peak_held_numel <= (2 * cap + 1) * numel
    assert max(waiting) == 0  # the uncapped run never holds items back
    assert results[1].peak_held_numel > (2 * cap + 1) * numel  # this interleaving would exceed the bound uncapped
    assert rel_err(capped.last_direction, uncapped.last_direction) <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_activation_checkpointing_streams_the_same_update_float64(make_policy, vocab_size, teacher64, objective):
    """Checkpointed layers recompute their forward in the backward: the streamed direction stays the sync one."""
    from tslightning.loop.startup import checkpoint_activations

    generator, shape = torch.Generator().manual_seed(7), WorkloadShape(num_groups=3, max_turns=3)
    if objective == "grpo":
        batch = synthetic_grpo_batch(vocab_size, 0, generator, shape)
    else:
        batch = synthetic_opd_batch(vocab_size, 0, generator, teacher64, shape)
    checkpointed = make_policy()
    checkpoint_activations(checkpointed)
    assert checkpointed.training and any(getattr(m, "gradient_checkpointing", False) for m in checkpointed.modules())
    streamed = run_update(checkpointed, batch.reordered(torch.Generator().manual_seed(8)), "thundersync")
    sync = run_update(make_policy(), batch, "sync")
    assert rel_err(streamed, sync) <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("seed", [0, 1])
def test_a_trajectory_of_several_sequences_streams_exactly_float64(make_policy, vocab_size, seed):
    """A harness that rewrote its history leaves a GRPO trajectory of several causal sequences (one score summed over
    them, Eq. 4): one pass per sequence, counted once; equal to the sync learner and the reference."""
    from reference import with_rewritten_histories

    shape = WorkloadShape(num_groups=3, group_size=3, max_turns=2)
    generator = torch.Generator().manual_seed(seed)
    batch = with_rewritten_histories(synthetic_grpo_batch(vocab_size, 0, generator, shape), vocab_size, generator)
    assert any(getattr(item, "segments", ()) for item in batch.items)
    reference = grpo_direction(make_policy(), batch)
    sync = run_update(make_policy(), batch, "sync")
    streamed = run_update(make_policy(), batch.reordered(torch.Generator().manual_seed(seed + 7)), "thundersync")
    queued = run_update(make_policy(), batch, "thundersync", fold_queue_depth=2, group_admission_cap=1)
    assert reference.any()
    for direction in (sync, streamed, queued):
        assert rel_err(direction, reference) <= FLOAT64_TOLERANCE
