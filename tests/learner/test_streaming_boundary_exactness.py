"""The streaming module under ``context_backward="boundary"`` takes the batch-synchronous update (Sec. 3.4, App. I).

Same protocol as test_streaming_exactness.py: one logical batch replayed in a random readiness order through the
thundersync module with the boundary-adjoint context backward, against the sync module (the recompute baseline).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model

from tslightning.core.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.core.sources import SourceError, TrajectorySource, TurnSource
from tslightning.learner.boundary_adjoint import ContextBackward
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.measure.learner_flops import DecoderShape, boundary_flops, source_flops
from tslightning.objectives.advantages import AdvantageEstimator

FLOAT64_TOLERANCE = 1e-10
FLOAT32_TOLERANCE = 1e-5
MODEL_SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

shapes = st.builds(
    WorkloadShape,
    num_groups=st.integers(1, 4),
    group_size=st.integers(2, 5),
    max_turns=st.integers(1, 4),
    prompt_tokens=st.sampled_from([(1, 3), (6, 14), (20, 40)]),
    action_tokens=st.tuples(st.integers(1, 4), st.integers(4, 12)),
    observation_tokens=st.tuples(st.integers(0, 4), st.integers(4, 16)),
    uniform_groups=st.integers(0, 1),
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def run_update(policy, batch: ReplayBatch, schedule: str, **module_kwargs) -> StreamingPolicyModule:
    module = StreamingPolicyModule(policy, objective=batch.plan.objective, schedule=schedule, **module_kwargs)
    optimizer = module.configure_optimizers()
    for item in batch.stream():
        module.ingest(item)
    module.barrier(optimizer)
    assert module.num_optimizer_steps == 1
    return module


def boundary_update(policy, batch: ReplayBatch, **module_kwargs) -> StreamingPolicyModule:
    return run_update(policy, batch, "thundersync", context_backward="boundary", **module_kwargs)


@MODEL_SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), estimator=st.sampled_from(list(AdvantageEstimator)))
def test_grpo_boundary_module_equals_sync_float64(make_policy, vocab_size, shape, seed, estimator):
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(seed), shape)
    sync = run_update(make_policy(), batch, "sync", advantage=estimator).last_direction
    streamed = boundary_update(
        make_policy(), batch.reordered(torch.Generator().manual_seed(seed + 1)), advantage=estimator
    ).last_direction
    if not bool(sync.any()):  # every group uniform
        assert torch.equal(streamed, torch.zeros_like(streamed))
        return
    assert rel_err(streamed, sync) <= FLOAT64_TOLERANCE


@MODEL_SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_opd_boundary_module_equals_sync_float64(make_policy, teacher64, vocab_size, shape, seed):
    batch = synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(seed), teacher64, shape)
    sync = run_update(make_policy(), batch, "sync").last_direction
    module = boundary_update(make_policy(), batch.reordered(torch.Generator().manual_seed(seed + 1)))
    assert rel_err(module.last_direction, sync) <= FLOAT64_TOLERANCE
    assert module.turn_boundaries.open_trajectories == []  # every turn graph released by the barrier


def test_module_serves_every_turn_and_frees_prompt_graphs(make_policy, teacher64, vocab_size):
    shape = WorkloadShape(num_groups=3, group_size=3, max_turns=3, prompt_tokens=(16, 24))
    grpo = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(31), shape)
    module = StreamingPolicyModule(make_policy(), schedule="thundersync", context_backward="boundary")
    optimizer = module.configure_optimizers()
    for item in grpo.reordered(torch.Generator().manual_seed(32)).stream():
        module.ingest(item)
        if type(item).__name__ == "GroupClosed":
            assert item.group_id not in module.shared_prompts.open_groups  # its prompt graph is gone at close
    assert len(module.service_log) == 9
    module.barrier(optimizer)
    opd = synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(33), teacher64, shape)
    turns_last_first = sorted((i for i in opd.items if isinstance(i, TurnSource)), key=lambda t: -t.turn_index)
    rest = [i for i in opd.items if not isinstance(i, TurnSource)]
    module = boundary_update(make_policy(), replace(opd, items=(*turns_last_first, *rest)))
    assert len(module.service_log) == len(turns_last_first)  # turns that waited for a predecessor still ran once
    assert rel_err(module.last_direction, run_update(make_policy(), opd, "sync").last_direction) <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("cap", [1, 2])
def test_admission_cap_with_boundary_keeps_exactness(make_policy, vocab_size, cap):
    shape = WorkloadShape(num_groups=5, group_size=3, max_turns=2, prompt_tokens=(10, 20))
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(5), shape)
    capped = boundary_update(make_policy(), batch.reordered(torch.Generator().manual_seed(6)), group_admission_cap=cap)
    sync = run_update(make_policy(), batch, "sync")
    assert rel_err(capped.last_direction, sync.last_direction) <= FLOAT64_TOLERANCE
    assert capped.last_update.peak_held_numel <= (2 * cap + 1) * capped.layout.numel


def _lora(policy):
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(7)
    return get_peft_model(policy, config)


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_lora_boundary_module_equals_sync_float64(make_policy, teacher64, vocab_size, objective):
    gen = torch.Generator().manual_seed(3)
    shape = WorkloadShape(prompt_tokens=(12, 24))
    batch = (
        synthetic_grpo_batch(vocab_size, 0, gen, shape)
        if objective == "grpo"
        else synthetic_opd_batch(vocab_size, 0, gen, teacher64, shape)
    )
    streamed = boundary_update(_lora(make_policy()), batch.reordered(torch.Generator().manual_seed(4)))
    sync = run_update(_lora(make_policy()), batch, "sync")
    assert rel_err(streamed.last_direction, sync.last_direction) <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_float32_boundary_module_equals_sync(make_policy, teacher64, vocab_size, objective):
    gen = torch.Generator().manual_seed(11)
    shape = WorkloadShape(prompt_tokens=(16, 32))
    batch = (
        synthetic_grpo_batch(vocab_size, 0, gen, shape)
        if objective == "grpo"
        else synthetic_opd_batch(vocab_size, 0, gen, teacher64, shape)
    )
    sync = run_update(make_policy(torch.float32), batch, "sync").last_direction
    streamed = boundary_update(make_policy(torch.float32), batch.reordered(torch.Generator().manual_seed(12)))
    assert streamed.last_direction.dtype == torch.float32
    assert rel_err(streamed.last_direction.double(), sync.double()) <= FLOAT32_TOLERANCE


def test_parameters_equal_after_several_updates_float64(make_policy, vocab_size):
    """Sync (recompute) and thundersync (boundary) from one θ_0 over 3 logical batches reach the same parameters."""
    sync_module = StreamingPolicyModule(make_policy(), schedule="sync")
    stream_module = StreamingPolicyModule(make_policy(), schedule="thundersync", context_backward="boundary")
    sync_opt, stream_opt = sync_module.configure_optimizers(), stream_module.configure_optimizers()
    theta0 = sync_module.layout.values()
    shape = WorkloadShape(prompt_tokens=(12, 24))
    for k in range(3):
        batch = synthetic_grpo_batch(vocab_size, k, torch.Generator().manual_seed(100 + k), shape)
        for item in batch.stream():
            sync_module.ingest(item)
        for item in batch.reordered(torch.Generator().manual_seed(200 + k)).stream():
            stream_module.ingest(item)
        sync_module.barrier(sync_opt)
        stream_module.barrier(stream_opt)
    moved = (sync_module.layout.values() - theta0).norm()
    assert moved > 0
    assert float((stream_module.layout.values() - sync_module.layout.values()).norm() / moved) <= FLOAT64_TOLERANCE


def test_boundary_is_refused_under_sync(make_policy):
    with pytest.raises(ValueError, match="recompute baseline"):
        StreamingPolicyModule(make_policy(), schedule="sync", context_backward="boundary")
    module = StreamingPolicyModule(make_policy(), schedule="thundersync")
    assert module.context_backward is ContextBackward.RECOMPUTE and module.shared_prompts is None


def test_trajectory_outside_the_group_prompt_is_refused_before_state_changes(make_policy, vocab_size):
    shape = WorkloadShape(num_groups=1, prompt_tokens=(8, 8), uniform_groups=0)
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(9), shape)
    module = StreamingPolicyModule(make_policy(), context_backward="boundary")
    module.ingest(batch.plan)
    first, second = (i for i in batch.items[:2] if isinstance(i, TrajectorySource))
    module.ingest(first)
    wrong = second.token_ids.clone()
    wrong[2] = (wrong[2] + 1) % vocab_size
    with pytest.raises(SourceError, match="shared prompt"):
        module.ingest(replace(second, token_ids=wrong))
    for item in batch.items[1:]:  # the refused item left no trace: the real one is accepted, the update completes
        module.ingest(item)
    module.barrier(module.configure_optimizers())
    sync = run_update(make_policy(), batch, "sync")
    assert bool(sync.last_direction.any())
    assert rel_err(module.last_direction, sync.last_direction) <= FLOAT64_TOLERANCE


def test_boundary_module_runs_fewer_flops(make_policy, teacher64, vocab_size):
    shape = WorkloadShape(num_groups=2, group_size=4, max_turns=3, prompt_tokens=(24, 32), uniform_groups=0)
    for batch in (
        synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(41), shape),
        synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(42), teacher64, replace(shape, max_turns=4)),
    ):
        module = boundary_update(make_policy(), batch)
        decoder = DecoderShape.from_config(module.policy.config)
        boundary = module.shared_prompts if batch.plan.objective == "grpo" else module.turn_boundaries
        recompute = sum(source_flops(decoder, record.tokens).total for record in module.service_log)
        assert 0 < boundary_flops(decoder, boundary.passes).total < recompute  # the ledger of the last update
