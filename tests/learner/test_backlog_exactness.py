"""A backlog served in padded passes (``ingest_ready``) is the same update: float64, random arrival orders split into
random backlogs, GRPO (every estimator, open and complete groups in one backlog, an admission cap, rewritten
histories), OPD and LoRA — against the sync schedule and the paper's equations."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from reference import grpo_direction, opd_direction, with_rewritten_histories
from test_streaming_exactness import FLOAT64_TOLERANCE, MODEL_SETTINGS, rel_err, run_update, shapes

from tslightning.core.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.core.sources import GroupClosed, TrajectorySource
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.objectives.advantages import AdvantageEstimator


def backlogs(batch: ReplayBatch, generator: torch.Generator, largest: int = 7) -> list[list]:
    """The batch's stream as a learner sees it when busy: its plan alone, then runs of 1 to ``largest`` items ready
    at once, in readiness order."""
    items, runs = list(batch.items), [[batch.plan]]
    while items:
        size = int(torch.randint(1, largest + 1, (1,), generator=generator))
        runs.append(items[:size])
        items = items[size:]
    return runs


def run_backlogged(policy, batch: ReplayBatch, runs: list[list], **module_kwargs) -> StreamingPolicyModule:
    module = StreamingPolicyModule(policy, objective=batch.plan.objective, schedule="thundersync", **module_kwargs)
    optimizer = module.configure_optimizers()
    for run in runs:
        module.ingest_ready(run)
    module.barrier(optimizer)
    return module


def passes(module: StreamingPolicyModule) -> int:
    """Learner passes of the last update (rows served together share one interval)."""
    return len({(record.start, record.end) for record in module.service_log})


@MODEL_SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), estimator=st.sampled_from(list(AdvantageEstimator)))
def test_grpo_backlogs_equal_sync_and_reference_float64(make_policy, vocab_size, shape, seed, estimator):
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(seed), shape)
    streamed = batch.reordered(torch.Generator().manual_seed(seed + 1))
    runs = backlogs(streamed, torch.Generator().manual_seed(seed + 2))
    reference = grpo_direction(make_policy(), batch, estimator.value)
    sync = run_update(make_policy(), batch, "sync", advantage=estimator)
    module = run_backlogged(make_policy(), streamed, runs, advantage=estimator, micro_batch_size=3)
    if not bool(reference.any()):
        assert torch.equal(module.last_direction, torch.zeros_like(module.last_direction))
        return
    assert rel_err(module.last_direction, sync) <= FLOAT64_TOLERANCE
    assert rel_err(module.last_direction, reference) <= FLOAT64_TOLERANCE


def test_one_backlog_with_open_and_complete_groups_is_exact_and_batched(make_policy, vocab_size):
    """A backlog holding a whole group (its rewards known: final weights, straight to the batch) beside part of an
    open group whose earlier sources were folded into its statistics, and the rest of it later."""
    shape = WorkloadShape(num_groups=3, group_size=4, max_turns=2, uniform_groups=0)
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(5), shape)
    by_group: dict[str, list] = {}
    for item in batch.items[:-1]:
        by_group.setdefault(item.group_id, []).append(item)
    (a, b, c) = by_group.values()  # each: 4 trajectory sources, then its GroupClosed
    runs = [[batch.plan], a[:1], [*a[1:3], *b, *c[:2]], [a[3], a[4], *c[2:], batch.items[-1]]]
    assert sum(len(run) for run in runs[1:]) == len(batch.items)
    module = run_backlogged(make_policy(), batch, runs, micro_batch_size=8)
    sync = run_update(make_policy(), batch, "sync")
    assert rel_err(module.last_direction, sync) <= FLOAT64_TOLERANCE
    assert rel_err(module.last_direction, grpo_direction(make_policy(), batch)) <= FLOAT64_TOLERANCE
    sources = sum(isinstance(item, TrajectorySource) for item in batch.items)
    assert passes(module) < sources  # served in fewer passes than sources
    closes = [item.group_id for run in runs[1:] for item in run if isinstance(item, GroupClosed)]
    assert [reduction.group_id for reduction in module.last_update.groups] == closes  # in arrival order


@MODEL_SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_opd_backlogs_equal_sync_and_reference_float64(make_policy, teacher64, vocab_size, shape, seed):
    batch = synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(seed), teacher64, shape)
    streamed = batch.reordered(torch.Generator().manual_seed(seed + 1))
    module = run_backlogged(make_policy(), streamed, backlogs(streamed, torch.Generator().manual_seed(seed + 2)))
    assert rel_err(module.last_direction, run_update(make_policy(), batch, "sync")) <= FLOAT64_TOLERANCE
    assert rel_err(module.last_direction, opd_direction(make_policy(), batch)) <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_admission_cap_and_rewritten_histories_keep_backlogs_exact(make_policy, vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    shape = WorkloadShape(num_groups=4, group_size=3, max_turns=2)
    batch = with_rewritten_histories(synthetic_grpo_batch(vocab_size, 0, generator, shape), vocab_size, generator)
    streamed = batch.reordered(generator)
    module = run_backlogged(
        make_policy(), streamed, backlogs(streamed, generator, largest=9), micro_batch_size=4, group_admission_cap=1
    )
    reference = grpo_direction(make_policy(), batch)
    assert rel_err(module.last_direction, reference) <= FLOAT64_TOLERANCE
    assert module.last_update.peak_held_numel <= 3 * module.layout.numel  # (2k + 1) with k = 1


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_lora_backlogs_equal_sync_float64(make_policy, teacher64, vocab_size, objective):
    def lora_policy():
        torch.manual_seed(3)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
        return get_peft_model(make_policy(), config)

    generator = torch.Generator().manual_seed(11)
    shape = WorkloadShape(num_groups=3, group_size=3, max_turns=2, uniform_groups=0)
    if objective == "grpo":
        batch = synthetic_grpo_batch(vocab_size, 0, generator, shape)
    else:
        batch = synthetic_opd_batch(vocab_size, 0, generator, teacher64, shape)
    streamed = batch.reordered(generator)
    module = run_backlogged(lora_policy(), streamed, backlogs(streamed, generator))
    assert rel_err(module.last_direction, run_update(lora_policy(), batch, "sync")) <= FLOAT64_TOLERANCE
    assert passes(module) < len(module.service_log)


def test_a_pass_holds_at_most_backlog_tokens(make_policy, vocab_size):
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(3), WorkloadShape(num_groups=3))
    longest = max(item.token_ids.numel() for item in batch.items if isinstance(item, TrajectorySource))
    module = run_backlogged(make_policy(), batch, [[batch.plan], list(batch.items)], backlog_tokens=2 * longest)
    by_pass: dict[tuple, list] = {}
    for record in module.service_log:
        by_pass.setdefault((record.start, record.end), []).append(record.tokens)
    assert all(len(rows) * max(rows) <= 2 * longest for rows in by_pass.values())
    assert 2 <= max(len(rows) for rows in by_pass.values()) < module.micro_batch_size  # batched, and the budget bound


def test_a_lone_ready_source_is_served_at_once_and_boundary_serves_per_source(make_policy, vocab_size):
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(4), WorkloadShape(num_groups=2))
    one_by_one = [[batch.plan], *([item] for item in batch.items)]
    module = run_backlogged(make_policy(), batch, one_by_one)
    sources = sum(isinstance(item, TrajectorySource) for item in batch.items)
    assert passes(module) == len(module.service_log) == sources
    boundary = run_backlogged(make_policy(), batch, [[batch.plan], list(batch.items)], context_backward="boundary")
    assert not boundary.serves_backlogs and passes(boundary) >= sources
