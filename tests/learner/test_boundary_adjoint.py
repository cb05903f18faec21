"""Boundary-adjoint context backward (App. I): the same gradients as recomputing every context, at lower FLOPs.

The GRPO shared-prefix and OPD turn-boundary learners are driven here with the exact accumulators the streaming
module uses and compared with tests/reference.py, which recomputes each source's whole context (App. I).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightning.fabric.utilities.throughput import measure_flops
from peft import LoraConfig, get_peft_model
from reference import grpo_direction, opd_direction

from tslightning.core.group_accumulator import GroupAccumulator, GroupReduction
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.core.sources import (
    GroupClosed,
    SourceError,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)
from tslightning.core.turn_accumulator import TurnAccumulator
from tslightning.learner.boundary_adjoint import (
    BoundaryStates,
    SharedPromptBackward,
    TurnBoundaryBackward,
    check_full_attention,
    forward_segment,
)
from tslightning.measure.learner_flops import (
    BoundaryPass,
    BoundaryWork,
    DecoderShape,
    FlopCount,
    WeightTraining,
    boundary_flops,
    boundary_pass_flops,
    matmul_flops,
    source_flops,
)
from tslightning.objectives.advantages import AdvantageEstimator
from tslightning.objectives.scored_logprobs import scored_logprobs

FLOAT64_TOLERANCE = 1e-10
FLOAT32_TOLERANCE = 1e-5
MODEL_SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

shapes = st.builds(
    WorkloadShape,
    num_groups=st.integers(1, 4),
    group_size=st.integers(2, 5),
    max_turns=st.integers(1, 4),
    prompt_tokens=st.sampled_from([(1, 3), (6, 14), (20, 40)]),  # a 1-token prompt has nothing to share
    action_tokens=st.tuples(st.integers(1, 4), st.integers(4, 12)),
    observation_tokens=st.tuples(st.integers(0, 4), st.integers(4, 16)),  # 0: a turn right after the last action
    uniform_groups=st.integers(0, 1),
)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def boundary_grpo_direction(policy, batch: ReplayBatch, estimator: str = "grpo") -> tuple[torch.Tensor, list]:
    """g_k through SharedPromptBackward + GroupAccumulator, in the batch's arrival order; also the passes run."""
    layout = ParameterLayout(policy.parameters())
    groups = GroupAccumulator(layout, AdvantageEstimator(estimator), dtype=torch.float64)
    prefix = SharedPromptBackward(policy, layout.parameters)
    plan = batch.plan
    for item in batch.items:
        if isinstance(item, TrajectorySource):
            prefix.admit(item)
            grads = prefix.source_gradient(item, 1.0 / (plan.num_prompts * item.num_scored))
            groups.add(item.group_id, plan.group_sizes[item.group_id], item.reward, grads)
        elif isinstance(item, GroupClosed):
            prompt_part = prefix.close_group(groups.close(item.group_id))
            if prompt_part is not None:
                layout.add_(groups.batch, prompt_part)
    assert prefix.open_groups == []  # every prompt graph was released at its group's close
    return groups.batch, prefix.passes


def boundary_opd_direction(policy, batch: ReplayBatch) -> tuple[torch.Tensor, list]:
    """g_k = Σ_j g_j / N_k through TurnBoundaryBackward + TurnAccumulator; also the passes run."""
    layout = ParameterLayout(policy.parameters())
    turns = TurnAccumulator(layout, torch.float64)
    boundary = TurnBoundaryBackward(policy, layout.parameters)
    for item in batch.items:
        if isinstance(item, TurnSource):
            for ready in boundary.admit(item):
                turns.add(boundary.turn_gradient(ready), ready.num_scored)
        elif isinstance(item, TrajectoryClosed):
            turns.add(boundary.close_trajectory(item.group_id, item.trajectory_index), 0)
    assert boundary.open_trajectories == []
    return turns.total / turns.num_tokens, boundary.passes


def recompute_flops(shape: DecoderShape, batch: ReplayBatch, training: WeightTraining | None = None) -> FlopCount:
    total = FlopCount()
    for item in batch.items:
        if isinstance(item, TrajectorySource | TurnSource):
            total += source_flops(shape, item.token_ids.numel(), training, item.num_scored)
    return total


def head_recompute_flops(shape: DecoderShape, passes: list[BoundaryPass]) -> int:
    """The chunked head's forward product rerun in the backward, which the ledger does not credit (recomputation)."""
    return sum(
        matmul_flops(p.head_tokens, shape.hidden_size, shape.vocab_size)
        for p in passes
        if p.work is BoundaryWork.CONTINUATION
    )


# ----------------------------------------------------------------- exactness, float64
@MODEL_SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), estimator=st.sampled_from(list(AdvantageEstimator)))
def test_grpo_shared_prefix_equals_recompute_float64(make_policy, vocab_size, shape, seed, estimator):
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(seed), shape)
    arrival = batch.reordered(torch.Generator().manual_seed(seed + 1))
    reference = grpo_direction(make_policy(), batch, estimator.value)
    streamed, passes = boundary_grpo_direction(make_policy(), arrival, estimator.value)
    if not bool(reference.any()):  # every group uniform: exactly zero, and no prompt backward ran
        assert torch.equal(streamed, torch.zeros_like(streamed))
        assert all(p.work is not BoundaryWork.DEFERRED_BACKWARD for p in passes)
        return
    assert rel_err(streamed, reference) <= FLOAT64_TOLERANCE


@MODEL_SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_opd_turn_boundaries_equal_recompute_float64(make_policy, teacher64, vocab_size, shape, seed):
    batch = synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(seed), teacher64, shape)
    arrival = batch.reordered(torch.Generator().manual_seed(seed + 1))
    reference = opd_direction(make_policy(), batch)
    streamed, _ = boundary_opd_direction(make_policy(), arrival)
    assert rel_err(streamed, reference) <= FLOAT64_TOLERANCE


def test_continuation_from_boundary_states_reproduces_full_forward(make_policy, vocab_size):
    """RoPE positions continue after the boundary: log-probs of [c, T) from cached K/V equal the full forward's."""
    policy = make_policy()
    ids = torch.randint(0, vocab_size, (23,), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(23, dtype=torch.bool)
    mask[:10] = False
    full, states = forward_segment(policy, ids, 0, [], mask)
    _, prefix = forward_segment(policy, ids[:9], 0, [])
    tail, joined = forward_segment(policy, ids, 9, prefix.leaves(9), mask)
    assert states.length == joined.length == 23
    assert tail.shape == (13,) and float((tail - full).abs().max().detach()) <= 1e-12
    default_positions = policy(input_ids=ids[None, 9:], past_key_values=BoundaryStates(prefix.leaves(9)).cache())
    logp = torch.log_softmax(default_positions.logits[0, :-1], -1).gather(-1, ids[10:, None])[:, 0]
    assert float((logp - full).abs().max().detach()) <= 1e-12  # default positions agree


def test_uniform_group_and_several_groups_long_prompts(make_policy, vocab_size):
    shape = WorkloadShape(num_groups=3, group_size=4, max_turns=3, prompt_tokens=(30, 48), uniform_groups=1)
    batch = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(21), shape)
    arrival = batch.reordered(torch.Generator().manual_seed(22))
    streamed, passes = boundary_grpo_direction(make_policy(), arrival)
    assert rel_err(streamed, grpo_direction(make_policy(), batch)) <= FLOAT64_TOLERANCE
    work = [p.work for p in passes]
    assert work.count(BoundaryWork.PREFIX_FORWARD) == 3  # one prompt forward per group, not per trajectory
    assert work.count(BoundaryWork.CONTINUATION) == 12
    assert work.count(BoundaryWork.DEFERRED_BACKWARD) == 2  # the uniform group's prompt needs no backward


def test_opd_turns_arriving_before_their_predecessor_wait(make_policy, teacher64, vocab_size):
    shape = WorkloadShape(num_groups=2, group_size=2, max_turns=4)
    batch = synthetic_opd_batch(vocab_size, 0, torch.Generator().manual_seed(8), teacher64, shape)
    turns = [i for i in batch.items if isinstance(i, TurnSource)]
    backwards = tuple(sorted(turns, key=lambda t: -t.turn_index)) + tuple(
        i for i in batch.items if not isinstance(i, TurnSource)
    )
    assert any(t.turn_index > 0 for t in turns)
    streamed, passes = boundary_opd_direction(make_policy(), replace(batch, items=backwards))
    assert rel_err(streamed, opd_direction(make_policy(), batch)) <= FLOAT64_TOLERANCE
    assert sum(p.work is BoundaryWork.CONTINUATION for p in passes) == len(turns)


def _lora(policy):
    config = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False
    )
    torch.manual_seed(7)
    return get_peft_model(policy, config)


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_lora_boundary_equals_recompute_float64(make_policy, teacher64, vocab_size, objective):
    gen = torch.Generator().manual_seed(3)
    shape = WorkloadShape(num_groups=2, group_size=3, prompt_tokens=(12, 20))
    if objective == "grpo":
        batch = synthetic_grpo_batch(vocab_size, 0, gen, shape)
        reference = grpo_direction(_lora(make_policy()), batch)
        streamed, _ = boundary_grpo_direction(_lora(make_policy()), batch.reordered(torch.Generator().manual_seed(4)))
    else:
        batch = synthetic_opd_batch(vocab_size, 0, gen, teacher64, shape)
        reference = opd_direction(_lora(make_policy()), batch)
        streamed, _ = boundary_opd_direction(_lora(make_policy()), batch.reordered(torch.Generator().manual_seed(4)))
    assert streamed.numel() == sum(p.numel() for n, p in _lora(make_policy()).named_parameters() if "lora_" in n)
    assert rel_err(streamed, reference) <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_float32_boundary_equals_recompute(make_policy, teacher64, vocab_size, objective):
    gen = torch.Generator().manual_seed(11)
    shape = WorkloadShape(num_groups=3, group_size=4, prompt_tokens=(16, 32))
    order = torch.Generator().manual_seed(12)
    if objective == "grpo":
        batch = synthetic_grpo_batch(vocab_size, 0, gen, shape)
        reference = grpo_direction(make_policy(torch.float32), batch)
        streamed, _ = boundary_grpo_direction(make_policy(torch.float32), batch.reordered(order))
    else:
        batch = synthetic_opd_batch(vocab_size, 0, gen, teacher64, shape)
        reference = opd_direction(make_policy(torch.float32), batch)
        streamed, _ = boundary_opd_direction(make_policy(torch.float32), batch.reordered(order))
    assert rel_err(streamed.double(), reference.double()) <= FLOAT32_TOLERANCE


# ----------------------------------------------------------------- prefix contracts
def _trajectory(prompt, tail, index, scored_from=None):
    ids = torch.cat([prompt, tail])
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[len(prompt) if scored_from is None else scored_from :] = True
    return TrajectorySource("g", index, ids, mask, 1.0, 0, min(len(prompt), scored_from or len(prompt)))


def test_trajectory_outside_its_groups_prompt_is_refused(make_policy):
    policy = make_policy()
    prefix = SharedPromptBackward(policy, [p for p in policy.parameters() if p.requires_grad])
    prompt, tail = torch.arange(1, 9), torch.arange(20, 25)
    first = _trajectory(prompt, tail, 0)
    prefix.admit(first)
    prefix.source_gradient(first, 0.5)
    other_prompt = prompt.clone()
    other_prompt[3] += 1
    with pytest.raises(SourceError, match="does not start with its group's shared prompt"):
        prefix.admit(_trajectory(other_prompt, tail, 1))
    with pytest.raises(SourceError, match="does not start with its group's shared prompt"):
        prefix.admit(_trajectory(prompt[:4], tail, 1))  # shorter than the group's prompt
    scores_prompt = _trajectory(prompt, tail, 1, scored_from=4)  # same tokens, but a shorter declared prompt
    with pytest.raises(SourceError, match="inside its group's shared prompt"):
        prefix.admit(replace(scores_prompt, prompt_length=3))
    prefix.admit(_trajectory(prompt, tail.flip(0), 1))  # the refusals changed nothing
    prefix.source_gradient(_trajectory(prompt, tail.flip(0), 1), 0.5)
    assert prefix.open_groups == ["g"]


def _turn(ids, index, scored=1):
    mask = torch.zeros(ids.numel(), dtype=torch.bool)
    mask[-scored:] = True
    return TurnSource("p", 0, index, ids, mask, torch.full((scored,), -1.0), 0)


def test_turn_that_does_not_extend_the_previous_one_is_refused(make_policy):
    policy = make_policy()
    boundary = TurnBoundaryBackward(policy, [p for p in policy.parameters() if p.requires_grad])
    history = torch.arange(1, 11)
    second = _turn(torch.cat([history, torch.arange(30, 34)]), 1)
    assert boundary.admit(second) == []  # waits for turn 0
    edited = history.clone()
    edited[5] = 99
    with pytest.raises(SourceError, match="first difference at position 5"):
        boundary.admit(_turn(edited, 0))  # turn 1, already admitted, does not extend this turn 0
    with pytest.raises(SourceError, match="does not extend"):
        boundary.admit(_turn(torch.cat([history, torch.arange(40, 46)]), 2))  # nor does this turn 2 extend turn 1
    first = _turn(history, 0)
    assert boundary.admit(first) == [first, second]
    with pytest.raises(SourceError, match="admitted twice"):
        boundary.admit(first)


def test_sliding_window_models_are_refused(make_policy):
    policy = make_policy(torch.float32)
    policy.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="full attention"):
        check_full_attention(policy)


# ----------------------------------------------------------------- learner FLOPs
SMALL = DecoderShape(
    hidden_size=4, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=2, intermediate_size=6, vocab_size=10
)


def test_boundary_passes_by_hand():
    # One layer, 3 new tokens after 2 cached ones: linear layers 320 FLOPs per token forward (see test_learner_flops);
    # attention products 2 heads · 2·3·2·5 = 120 each; LM head included in the 320.
    continuation = boundary_pass_flops(SMALL, BoundaryPass(BoundaryWork.CONTINUATION, 3, 2))
    assert continuation == FlopCount(320 * 3 + 2 * 120, 2 * (320 * 3 + 2 * 120))
    # Without context a continuation is a recompute source.
    assert boundary_pass_flops(SMALL, BoundaryPass(BoundaryWork.CONTINUATION, 7)) == source_flops(SMALL, 7)
    # The LM head runs over the scored rows only: 2 of 7 here (80 FLOPs per row forward, twice that backward).
    scored = boundary_pass_flops(SMALL, BoundaryPass(BoundaryWork.CONTINUATION, 7, scored_tokens=2))
    assert scored == source_flops(SMALL, 7, scored_tokens=2)
    assert scored + FlopCount(80, 160) * 5 == source_flops(SMALL, 7)
    # Prefix forward: the decoder only (no LM head: 320 − 80 per token), full square attention 2·2·2·4·4 = 128 each.
    assert boundary_pass_flops(SMALL, BoundaryPass(BoundaryWork.PREFIX_FORWARD, 4)) == FlopCount(240 * 4 + 256, 0)
    # Deferred backward of a one-layer prefix: only its K and V projections (2·4·4·2 each, weight + input grad).
    assert boundary_pass_flops(SMALL, BoundaryPass(BoundaryWork.DEFERRED_BACKWARD, 4)) == FlopCount(0, 2 * 2 * 64)


@pytest.mark.parametrize("training", ["full", "lora"])
def test_boundary_flops_agree_with_measure_flops_on_meta(make_policy, vocab_size, training):
    """The ledger equals torch's flop counter over the real passes of one GRPO group and one OPD trajectory.

    On the meta device attention runs as plain products, which the counter sees (see test_learner_flops)."""
    config = make_policy(torch.float32).config
    with torch.device("meta"):
        model = transformers.Qwen2ForCausalLM(config)
    if training == "lora":
        targets = ["q_proj", "k_proj", "v_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets))
    shape, weights = DecoderShape.from_config(config), WeightTraining.from_model(model)
    params = [p for p in model.parameters() if p.requires_grad]
    workload = WorkloadShape(num_groups=1, group_size=3, prompt_tokens=(12, 12))
    group = [s for s in synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(5), workload).items[:3]]
    prefix = SharedPromptBackward(model, params)

    def run_group():
        for source in group:
            prefix.admit(source)
            prefix.source_gradient(source, 1.0)
        prefix.close_group(GroupReduction("group-0", (0.0, 1.0, 0.5), 0.5, 1.0, False))

    measured = measure_flops(model, run_group)
    assert measured == boundary_flops(shape, prefix.passes, weights).total + head_recompute_flops(shape, prefix.passes)
    assert [p.work for p in prefix.passes].count(BoundaryWork.DEFERRED_BACKWARD) == 1
    turns = TurnBoundaryBackward(model, params)
    ids = torch.arange(30) % vocab_size

    def run_trajectory():
        for j, length in enumerate((10, 19, 30)):
            mask = torch.arange(length) >= length - 3  # each turn scores its last 3 tokens
            for ready in turns.admit(TurnSource("p", 0, j, ids[:length], mask, torch.full((3,), -1.0), 0)):
                turns.turn_gradient(ready)
        turns.close_trajectory("p", 0)

    measured = measure_flops(model, run_trajectory)
    assert measured == boundary_flops(shape, turns.passes, weights).total + head_recompute_flops(shape, turns.passes)
    assert [p.work for p in turns.passes].count(BoundaryWork.DEFERRED_BACKWARD) == 2


def test_boundary_flops_below_recompute(make_policy, teacher64, vocab_size):
    policy = make_policy()
    shape = DecoderShape.from_config(policy.config)
    workload = WorkloadShape(num_groups=3, group_size=4, max_turns=3, prompt_tokens=(20, 40), uniform_groups=0)
    grpo = synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(1), workload)
    _, passes = boundary_grpo_direction(policy, grpo)
    assert boundary_flops(shape, passes).total < 0.6 * recompute_flops(shape, grpo).total
    opd = synthetic_opd_batch(
        vocab_size, 0, torch.Generator().manual_seed(2), teacher64, replace(workload, max_turns=4)
    )
    _, passes = boundary_opd_direction(make_policy(), opd)
    assert boundary_flops(shape, passes).total < recompute_flops(shape, opd).total
    single_turn = synthetic_opd_batch(
        vocab_size, 0, torch.Generator().manual_seed(2), teacher64, replace(workload, max_turns=1)
    )
    _, passes = boundary_opd_direction(make_policy(), single_turn)
    assert boundary_flops(shape, passes) == recompute_flops(shape, single_turn)  # nothing to share in one turn


def test_scored_logprobs_agree_with_segment_path(make_policy, vocab_size):
    """Guard for the tests above: the boundary path sees the same log-probabilities as scored_logprobs."""
    policy = make_policy()
    ids = torch.randint(0, vocab_size, (30,), generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(30, dtype=torch.bool)
    mask[12:20] = True
    _, prefix = forward_segment(policy, ids[:11], 0, [])
    logp, _ = forward_segment(policy, ids, 11, prefix.leaves(11), mask, chunk_tokens=3)
    expected = scored_logprobs(policy, ids, mask)
    assert float((logp - expected).abs().max().detach()) <= 1e-12
