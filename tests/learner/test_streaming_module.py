"""The StreamingPolicyModule as a learner: one step per logical batch, clipping, versions, atomic errors, Lightning.

Everything runs the tiny Qwen2 in float64 on small synthetic batches, so the update is checked to ~1e-12 and a
wrong scale, a lost or double-counted source, or a partial state change on a rejected item shows up.
"""

from __future__ import annotations

import math
from dataclasses import replace

import lightning as L
import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.core.sources import (
    BatchClosed,
    GroupClosed,
    PolicyVersionError,
    SourceError,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)
from tslightning.learner.streaming_module import OptimizerSettings, StreamingPolicyModule

TIGHT = 1e-12
FLOAT64_TOLERANCE = 1e-10
TORCH_CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_ divides by (total_norm + 1e-6)

SMALL = WorkloadShape(
    num_groups=2,
    group_size=3,
    max_turns=2,
    prompt_tokens=(3, 6),
    action_tokens=(2, 4),
    observation_tokens=(2, 4),
    uniform_groups=0,
)
SCHEDULES = ["sync", "thundersync"]
# (schedule, group_admission_cap) under which a rejected item must leave the learner untouched.
ERROR_SETTINGS = [("thundersync", None), ("thundersync", 1), ("sync", None)]


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """The tiny model is fastest on one thread; on a loaded 2-core box extra threads thrash (≈30x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- helpers
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def grpo_batch(vocab_size: int, version: int = 0, seed: int = 0, shape: WorkloadShape = SMALL) -> ReplayBatch:
    return synthetic_grpo_batch(vocab_size, version, torch.Generator().manual_seed(seed), shape)


def opd_batch(vocab_size: int, teacher, version: int = 0, seed: int = 0, shape: WorkloadShape = SMALL) -> ReplayBatch:
    return synthetic_opd_batch(vocab_size, version, torch.Generator().manual_seed(seed), teacher, shape)


def batch_for(objective: str, vocab_size: int, teacher, seed: int = 0) -> ReplayBatch:
    return grpo_batch(vocab_size, seed=seed) if objective == "grpo" else opd_batch(vocab_size, teacher, seed=seed)


def count_steps(optimizer: torch.optim.Optimizer) -> list[int]:
    """A one-element counter of completed ``optimizer.step()`` calls."""
    calls = [0]

    def hook(opt, args, kwargs):
        calls[0] += 1

    optimizer.register_step_post_hook(hook)
    return calls


def ingest_all(module: StreamingPolicyModule, items) -> None:
    for item in items:
        module.ingest(item)


def clean_direction(policy, batch: ReplayBatch, **kwargs) -> torch.Tensor:
    """g_k of a clean, in-order ``sync`` replay of ``batch`` (the batch-synchronous baseline)."""
    module = StreamingPolicyModule(policy, objective=batch.plan.objective, schedule="sync", **kwargs)
    ingest_all(module, batch.stream())
    module.barrier(module.configure_optimizers())
    return module.last_direction


def uniform_groups_of(batch: ReplayBatch) -> set[str]:
    rewards: dict[str, list[float]] = {}
    for item in batch.items:
        if isinstance(item, TrajectorySource):
            rewards.setdefault(item.group_id, []).append(item.reward)
    return {g for g, r in rewards.items() if all(x == r[0] for x in r)}


def snapshot(module: StreamingPolicyModule) -> dict:
    """Every piece of learner state an ingested item or a barrier can touch, copied."""
    registry = module._registry
    groups, turns = module.groups, module.turns  # one of them, the objective's
    return {
        "batch": module.statistics.accumulator.clone(),
        "open_groups": {
            gid: (s.size, s.shift, s.g1.clone(), s.g2.clone(), list(s.rewards))
            for gid, s in (groups._open.items() if groups is not None else ())
        },
        "peak_held_numel": module.statistics.peak_held_numel,
        "turns_num_tokens": turns.num_tokens if turns is not None else 0,
        "num_waiting": module.admission.num_waiting,
        "admission_open": sorted(module.admission.open),
        "admission_waiting": [(g, [id(i) for i in items]) for g, items in module.admission._waiting.items()],
        "num_sources": module._num_sources,
        "num_scored_tokens": module._num_scored_tokens,
        "held_sources": [id(s) for s in module._held_sources],
        "reductions": list(module._reductions),
        "registry": None
        if registry is None
        else (
            registry.batch_closed,
            {
                gid: (g.size, sorted(g.finished), {t: sorted(v) for t, v in g.turns.items()}, g.closed)
                for gid, g in registry._groups.items()
            },
        ),
        "policy_version": module.policy_version,
        "num_optimizer_steps": module.num_optimizer_steps,
        "parameters": module.layout.values(),
        "grads_none": [p.grad is None for p in module.layout.parameters],
    }


def assert_same_state(before: dict, after: dict, label: str) -> None:
    assert before.keys() == after.keys()
    for key, old in before.items():
        new = after[key]
        if isinstance(old, torch.Tensor):
            assert torch.equal(old, new), f"{label}: {key} changed"
        elif key == "open_groups":
            assert old.keys() == new.keys(), f"{label}: open groups changed"
            for gid, (size, shift, g1, g2, rewards) in old.items():
                n_size, n_shift, n_g1, n_g2, n_rewards = new[gid]
                assert (size, shift, rewards) == (n_size, n_shift, n_rewards), f"{label}: group {gid} changed"
                assert torch.equal(g1, n_g1) and torch.equal(g2, n_g2), f"{label}: group {gid} statistics changed"
        else:
            assert old == new, f"{label}: {key} changed from {old!r} to {new!r}"


def expect_rejected(module: StreamingPolicyModule, action, error, pattern: str, label: str, steps=None) -> None:
    """``action()`` raises ``error`` whose message matches ``pattern``; the learner state is bitwise unchanged."""
    before = snapshot(module)
    taken = None if steps is None else steps[0]
    with pytest.raises(error, match=pattern):
        action()
    assert_same_state(before, snapshot(module), label)
    if steps is not None:
        assert steps[0] == taken, f"{label}: an optimizer step happened"


# --------------------------------------------------------------------------- 1. one step per logical batch
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_exactly_one_optimizer_step_per_logical_batch(make_policy, vocab_size, schedule):
    module = StreamingPolicyModule(make_policy(), schedule=schedule)
    optimizer = module.configure_optimizers()
    steps = count_steps(optimizer)
    for k in range(3):
        batch = grpo_batch(vocab_size, version=k, seed=10 + k).reordered(torch.Generator().manual_seed(k))
        theta = module.layout.values()
        ingest_all(module, batch.stream())
        assert steps[0] == k, "an optimizer step happened during ingest"
        assert torch.equal(module.layout.values(), theta), "parameters moved before the barrier"
        assert module.policy_version == k and module.num_optimizer_steps == k
        result = module.barrier(optimizer)
        assert steps[0] == k + 1
        assert result.policy_version == k + 1 == module.policy_version
        assert not torch.equal(module.layout.values(), theta), "the barrier's step did not move θ"
        assert all(p.grad is None for p in module.layout.parameters)
    assert steps[0] == 3 and module.num_optimizer_steps == 3 and module.policy_version == 3
    with pytest.raises(SourceError, match="no logical batch is open"):
        module.barrier(optimizer)
    assert steps[0] == 3 and module.num_optimizer_steps == 3 and module.policy_version == 3


def test_sync_micro_batches_hold_sequences_of_similar_length(make_policy, vocab_size):
    """The baseline sorts sources by length before padding them together, so it is not slowed by padding."""
    module = StreamingPolicyModule(make_policy(), schedule="sync", micro_batch_size=2)
    batch = grpo_batch(vocab_size, seed=3)
    ingest_all(module, batch.stream())
    module.barrier(module.configure_optimizers())
    lengths = [record.tokens for record in module.service_log]
    assert lengths == sorted(lengths, reverse=True) and len(set(lengths)) > 1
    assert len({(r.start, r.end) for r in module.service_log}) == math.ceil(len(lengths) / 2)


# --------------------------------------------------------------------------- 2. clipping
def _sgd_update(make_policy, batch: ReplayBatch, max_grad_norm: float):
    """One update with SGD(lr=1): θ_{k+1} − θ_k = clip(g_k). Also records the .grad the optimizer saw."""
    module = StreamingPolicyModule(make_policy(), objective=batch.plan.objective, max_grad_norm=max_grad_norm)
    optimizer = torch.optim.SGD(module.layout.parameters, lr=1.0)
    seen = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(module.layout.read_grads(torch.float64)))
    theta = module.layout.values()
    ingest_all(module, batch.stream())
    result = module.barrier(optimizer)
    assert len(seen) == 1
    return module, result, module.layout.values() - theta, seen[0]


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_clipping_acts_on_the_batch_directions_global_norm(make_policy, teacher64, vocab_size, objective):
    batch = batch_for(objective, vocab_size, teacher64, seed=1)

    # c far above ‖g_k‖: no clipping, the step is g_k itself and .grad was −g_k.
    module, result, step, grad = _sgd_update(make_policy, batch, max_grad_norm=1e6)
    g = module.last_direction
    norm = float(g.norm())
    assert norm > 0
    assert result.direction_norm == pytest.approx(norm, rel=TIGHT)
    assert result.clip_coefficient == 1.0
    assert rel_err(step, g) <= TIGHT
    assert rel_err(grad, -g) <= TIGHT

    # c = ‖g_k‖/4: the step is g_k scaled to norm c (torch's clip_grad_norm_: coefficient c / (‖g_k‖ + 1e-6)).
    c = norm / 4
    module, result, step, grad = _sgd_update(make_policy, batch, max_grad_norm=c)
    g_clipped = module.last_direction
    assert torch.equal(g_clipped, g), "last_direction must be the pre-clip g_k, independent of max_grad_norm"
    coefficient = c / (norm + TORCH_CLIP_EPS)
    assert result.direction_norm == pytest.approx(norm, rel=TIGHT)
    assert result.clip_coefficient == pytest.approx(coefficient, rel=TIGHT)
    assert float(step.norm()) == pytest.approx(c * norm / (norm + TORCH_CLIP_EPS), rel=TIGHT)
    assert float(step.norm()) == pytest.approx(c, rel=2 * TORCH_CLIP_EPS / norm)  # = c up to torch's 1e-6
    cosine = float(step @ g / (step.norm() * g.norm()))
    assert cosine >= 1 - TIGHT
    assert rel_err(step, coefficient * g) <= TIGHT
    assert rel_err(grad, -coefficient * g) <= TIGHT
    assert float(step.norm()) / norm == pytest.approx(result.clip_coefficient, rel=TIGHT)
    assert all(p.grad is None for p in module.layout.parameters)


# --------------------------------------------------------------------------- 3. uniform-reward groups
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_all_uniform_batch_has_exactly_zero_direction_and_still_steps(make_policy, vocab_size, schedule):
    shape = replace(SMALL, num_groups=2, uniform_groups=2)
    batch = grpo_batch(vocab_size, seed=2, shape=shape)
    module = StreamingPolicyModule(make_policy(), schedule=schedule)
    optimizer = module.configure_optimizers()
    steps = count_steps(optimizer)
    theta = module.layout.values()
    ingest_all(module, batch.reordered(torch.Generator().manual_seed(0)).stream())
    result = module.barrier(optimizer)
    direction = module.last_direction
    assert torch.equal(direction, torch.zeros_like(direction))
    assert steps[0] == 1 and module.num_optimizer_steps == 1 and module.policy_version == 1
    assert result.direction_norm == 0.0 and result.clip_coefficient == 1.0
    assert torch.equal(module.layout.values(), theta)  # a zero direction moves nothing (AdamW, weight_decay 0)
    assert sorted(r.group_id for r in result.groups) == sorted(batch.plan.group_sizes)
    for reduction in result.groups:
        assert reduction.uniform is True and reduction.scale == 0.0
        assert reduction.mean == 1.5 and len(reduction.rewards) == shape.group_size


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_uniform_group_contributes_exactly_nothing_next_to_a_learning_group(make_policy, vocab_size, schedule):
    shape = replace(SMALL, num_groups=2, group_size=4, uniform_groups=1)
    batch = grpo_batch(vocab_size, seed=3, shape=shape)
    assert uniform_groups_of(batch) == {"group-0"}  # guard: group-1 carries a learning signal
    module = StreamingPolicyModule(make_policy(), schedule=schedule)
    ingest_all(module, batch.stream())
    result = module.barrier(module.configure_optimizers())
    by_group = {r.group_id: r for r in result.groups}
    assert by_group["group-0"].uniform is True and by_group["group-0"].scale == 0.0
    assert by_group["group-1"].uniform is False and by_group["group-1"].scale > 0.0
    assert bool(module.last_direction.any())

    # The same batch without the uniform group (P kept at 2, so token weights 1/(P·L_i) are unchanged).
    plan = BatchPlan(Objective.GRPO, 0, {"group-1": 4}, global_num_prompts=2)
    items = tuple(i for i in batch.items if getattr(i, "group_id", "group-1") == "group-1")
    alone = StreamingPolicyModule(make_policy(), schedule=schedule)
    ingest_all(alone, ReplayBatch(plan, items).stream())
    alone.barrier(alone.configure_optimizers())
    if schedule == "thundersync":  # identical folds, and the uniform group adds not even a rounding residue
        assert torch.equal(module.last_direction, alone.last_direction)
    assert rel_err(module.last_direction, alone.last_direction) <= FLOAT64_TOLERANCE


# --------------------------------------------------------------------------- 4. policy versions
def test_policy_version_is_enforced(make_policy, vocab_size):
    batch = grpo_batch(vocab_size, version=0, seed=4)
    module = StreamingPolicyModule(make_policy())
    optimizer = module.configure_optimizers()

    with pytest.raises(PolicyVersionError, match="BatchPlan.policy_version is 1"):
        module.ingest(replace(batch.plan, policy_version=1))
    assert module._registry is None

    module.ingest(batch.plan)
    first = batch.items[0]
    assert isinstance(first, TrajectorySource)
    expect_rejected(
        module,
        lambda: module.ingest(replace(first, policy_version=1)),
        PolicyVersionError,
        "TrajectorySource.policy_version is 1",
        "stale source",
    )
    ingest_all(module, batch.items[:-1])  # the correctly stamped source is still accepted afterwards
    expect_rejected(
        module, lambda: module.ingest(BatchClosed(1)), PolicyVersionError, "BatchClosed.policy_version", "BatchClosed"
    )
    module.ingest(batch.items[-1])
    module.barrier(optimizer)
    assert module.policy_version == 1

    # The version-0 batch cannot be replayed into update 1; its version-1 restamp can.
    with pytest.raises(PolicyVersionError, match="BatchPlan.policy_version is 0"):
        module.ingest(batch.plan)
    ingest_all(module, batch.with_version(1).stream())
    assert module.barrier(optimizer).policy_version == 2 == module.policy_version


# --------------------------------------------------------------------------- 5. atomic rejection of bad input
def _grpo_partial_order(batch: ReplayBatch):
    """Group 0 complete and closed, groups 1 and 2 with one source each; the rest to finish the batch."""
    by_group: dict[str, list] = {}
    for item in batch.items:
        if not isinstance(item, BatchClosed):
            by_group.setdefault(item.group_id, []).append(item)
    g0, g1, g2 = by_group["group-0"], by_group["group-1"], by_group["group-2"]
    partial = [batch.plan, *g0, g1[0], g2[0]]
    rest = [*g1[1:], *g2[1:], batch.items[-1]]
    return partial, rest, g0, g1, g2


@pytest.mark.parametrize(("schedule", "cap"), ERROR_SETTINGS)
def test_grpo_bad_input_is_rejected_without_touching_learner_state(make_policy, vocab_size, schedule, cap):
    shape = replace(SMALL, num_groups=3, group_size=3, uniform_groups=1)
    batch = grpo_batch(vocab_size, seed=5, shape=shape)
    module = StreamingPolicyModule(make_policy(), schedule=schedule, group_admission_cap=cap)
    optimizer = module.configure_optimizers()
    steps = count_steps(optimizer)
    partial, rest, g0, g1, g2 = _grpo_partial_order(batch)
    ingest_all(module, partial)
    if schedule == "thundersync":  # the interesting states exist: statistics held, and with cap=1 a waiting source
        assert module.groups.open_groups == (["group-1"] if cap == 1 else ["group-1", "group-2"])
        assert module.admission.num_waiting == (1 if cap == 1 else 0)
        assert bool(module.groups._open["group-1"].g2.any())
    pending = g1[1]  # a valid, not yet ingested source of an open group
    too_big, too_big_waiting = pending.token_ids.clone(), g2[1].token_ids.clone()
    too_big[-1] = too_big_waiting[-1] = vocab_size
    turn = TurnSource("group-1", 1, 0, pending.token_ids, pending.scored_mask, -torch.ones(pending.num_scored), 0)

    def ingest(item):
        return lambda: module.ingest(item)

    cases = [
        ("mask length", lambda: replace(pending, scored_mask=pending.scored_mask[:-1]), "scored_mask has"),
        ("NaN reward", lambda: replace(pending, reward=float("nan")), "reward must be a finite number"),
        ("inf reward", lambda: replace(pending, reward=math.inf), "reward must be a finite number"),
        ("-inf reward", lambda: replace(pending, reward=-math.inf), "reward must be a finite number"),
        (
            "empty mask",
            lambda: replace(pending, scored_mask=torch.zeros_like(pending.scored_mask)),
            "scored_mask scores no token",
        ),
        ("token id >= vocab", ingest(replace(pending, token_ids=too_big)), r"token_ids .*vocabulary"),
        (
            "token id >= vocab, waiting group",
            ingest(replace(g2[1], token_ids=too_big_waiting)),
            r"token_ids .*vocabulary",
        ),
        ("group closed twice", ingest(GroupClosed("group-0")), "already closed"),
        ("unknown group", ingest(replace(pending, group_id="group-9")), "unknown group 'group-9'"),
        ("source for a closed group", ingest(g0[0]), "'group-0', which is already closed"),
        ("duplicate trajectory", ingest(g1[0]), "arrived twice"),
        ("duplicate of a waiting trajectory", ingest(g2[0]), "arrived twice"),
        ("index outside group", ingest(replace(pending, trajectory_index=3)), "trajectory_index 3 is outside"),
        ("early GroupClosed", ingest(GroupClosed("group-1")), "missing for trajectory indices"),
        ("early BatchClosed", ingest(BatchClosed(0)), "groups are open"),
        ("TrajectoryClosed in GRPO", ingest(TrajectoryClosed("group-1", 1, 1)), "TrajectoryClosed in a GRPO batch"),
        ("TurnSource in GRPO", ingest(turn), "TurnSource in a grpo batch"),
        ("second BatchPlan", ingest(batch.plan), "while batch 0 is open"),
        ("barrier with open groups", lambda: module.barrier(optimizer), "still open"),
    ]
    for label, action, pattern in cases:
        expect_rejected(module, action, SourceError, pattern, label, steps)

    ingest_all(module, rest)
    result = module.barrier(optimizer)
    assert steps[0] == 1 and module.policy_version == 1
    clean = clean_direction(make_policy(), batch)
    assert bool(clean.any())
    assert rel_err(module.last_direction, clean) <= FLOAT64_TOLERANCE
    assert result.num_sources == batch.plan.num_trajectories
    assert result.num_scored_tokens == sum(i.num_scored for i in batch.items if isinstance(i, TrajectorySource))
    assert sorted(r.group_id for r in result.groups) == sorted(batch.plan.group_sizes)


def _opd_partial_order(batch: ReplayBatch):
    """prompt-0 closed; prompt-1 trajectory 0 closed; prompt-1 trajectory 1 with only its first turn."""
    by_trajectory: dict[tuple[str, int], list] = {}
    closes = {}
    for item in batch.items:
        if isinstance(item, TurnSource | TrajectoryClosed):
            by_trajectory.setdefault((item.group_id, item.trajectory_index), []).append(item)
        elif isinstance(item, GroupClosed):
            closes[item.group_id] = item
    p00, p01 = by_trajectory[("prompt-0", 0)], by_trajectory[("prompt-0", 1)]
    p10, p11 = by_trajectory[("prompt-1", 0)], by_trajectory[("prompt-1", 1)]
    partial = [batch.plan, *p00, *p01, closes["prompt-0"], *p10, p11[0]]
    rest = [*p11[1:], closes["prompt-1"], batch.items[-1]]
    return partial, rest, p00, p10, p11


@pytest.mark.parametrize(("schedule", "cap"), ERROR_SETTINGS)
def test_opd_bad_input_is_rejected_without_touching_learner_state(make_policy, teacher64, vocab_size, schedule, cap):
    batch = opd_batch(vocab_size, teacher64, seed=6, shape=replace(SMALL, num_groups=2, group_size=2))
    module = StreamingPolicyModule(make_policy(), objective="opd", schedule=schedule, group_admission_cap=cap)
    optimizer = module.configure_optimizers()
    steps = count_steps(optimizer)
    partial, rest, p00, p10, p11 = _opd_partial_order(batch)
    ingest_all(module, partial)
    if schedule == "thundersync":
        assert module.turns.num_tokens > 0 and bool(module.turns.total.any())
    pending = p11[0]  # an ingested turn of the still open trajectory (prompt-1, 1)
    closed_turn = p10[0]  # a turn of the closed trajectory (prompt-1, 0)
    logprobs = pending.teacher_logprobs
    nan_logprobs = logprobs.clone()
    nan_logprobs[0] = float("nan")
    too_big = pending.token_ids.clone()
    too_big[0] = vocab_size
    n_turns = len([i for i in p11 if isinstance(i, TurnSource)])
    source = TrajectorySource("prompt-1", 1, pending.token_ids, pending.scored_mask, 1.0, 0, 1)

    def ingest(item):
        return lambda: module.ingest(item)

    cases = [
        ("teacher too long", lambda: replace(pending, teacher_logprobs=torch.cat([logprobs, logprobs[:1]])), "has"),
        ("teacher too short", lambda: replace(pending, teacher_logprobs=logprobs[:-1]), "teacher_logprobs has"),
        ("teacher NaN", lambda: replace(pending, teacher_logprobs=nan_logprobs), "teacher_logprobs contains NaN"),
        ("teacher positive", lambda: replace(pending, teacher_logprobs=-logprobs + 1), "positive value"),
        ("mask length", lambda: replace(pending, scored_mask=pending.scored_mask[:-1]), "scored_mask has"),
        ("token id >= vocab", ingest(replace(pending, token_ids=too_big, turn_index=9)), r"token_ids .*vocabulary"),
        ("turn after its trajectory closed", ingest(replace(closed_turn, turn_index=7)), "already closed"),
        ("duplicate turn", ingest(pending), "arrived twice"),
        ("stale turn", ingest(replace(pending, turn_index=9, policy_version=1)), "policy_version is 1"),
        (
            "TrajectoryClosed with a missing turn",
            ingest(TrajectoryClosed("prompt-1", 1, n_turns + 1)),
            r"turns missing=\[",
        ),
        ("trajectory closed twice", ingest(TrajectoryClosed("prompt-1", 0, len(p10) - 1)), "closed twice"),
        ("turn for a closed group", ingest(p00[0]), "'prompt-0', which is already closed"),
        ("unknown group", ingest(replace(pending, group_id="prompt-9")), "unknown group 'prompt-9'"),
        ("early GroupClosed", ingest(GroupClosed("prompt-1")), "closed trajectories missing"),
        ("early BatchClosed", ingest(BatchClosed(0)), "groups are open"),
        ("TrajectorySource in OPD", ingest(source), "TrajectorySource in a opd batch"),
        ("barrier with open groups", lambda: module.barrier(optimizer), "still open"),
    ]
    for label, action, pattern in cases:
        expect_rejected(module, action, SourceError, pattern, label, steps)

    ingest_all(module, rest)
    result = module.barrier(optimizer)
    assert steps[0] == 1 and module.policy_version == 1
    clean_module = StreamingPolicyModule(make_policy(), objective="opd", schedule="sync")
    ingest_all(clean_module, batch.stream())
    clean_result = clean_module.barrier(clean_module.configure_optimizers())
    assert rel_err(module.last_direction, clean_module.last_direction) <= FLOAT64_TOLERANCE
    num_turns = sum(isinstance(i, TurnSource) for i in batch.items)
    assert result.num_sources == clean_result.num_sources == num_turns
    assert result.num_scored_tokens == clean_result.num_scored_tokens


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_barrier_without_progress_is_rejected(make_policy, teacher64, vocab_size, objective):
    batch = batch_for(objective, vocab_size, teacher64, seed=7)
    module = StreamingPolicyModule(make_policy(), objective=objective)
    optimizer = module.configure_optimizers()
    steps = count_steps(optimizer)
    expect_rejected(
        module, lambda: module.barrier(optimizer), SourceError, "no logical batch is open", "no plan", steps
    )
    module.ingest(batch.plan)
    expect_rejected(
        module,
        lambda: module.barrier(optimizer),
        SourceError,
        r"still open.* and BatchClosed has not arrived",
        "plan only",
        steps,
    )
    assert module.num_optimizer_steps == 0 and module.policy_version == 0


# --------------------------------------------------------------------------- 6. Lightning Trainer and Fabric
def _trainer(tmp_path) -> L.Trainer:
    return L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


def _direct_parameters(make_policy, batch: ReplayBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """θ_0 and θ_1 of ``batch`` replayed straight through ingest/barrier with the module's own AdamW."""
    module = StreamingPolicyModule(make_policy(), objective=batch.plan.objective)
    theta0 = module.layout.values()
    ingest_all(module, batch.stream())
    module.barrier(module.configure_optimizers())
    return theta0, module.layout.values()


def _fit_and_check(module_cls, make_policy, batch: ReplayBatch, tmp_path) -> None:
    loader = DataLoader(list(batch.stream()), batch_size=None)
    assert [type(x) for x in loader] == [type(x) for x in batch.stream()]  # batch_size=None: items unchanged
    assert all(a is b for a, b in zip(loader, batch.stream(), strict=True))
    module = module_cls(make_policy(), objective=batch.plan.objective)
    calls = [0]

    def hook(opt, args, kwargs):
        calls[0] += 1

    handle = register_optimizer_step_post_hook(hook)
    try:
        _trainer(tmp_path).fit(module, train_dataloaders=loader)
    finally:
        handle.remove()
    assert calls[0] == 1 and module.num_optimizer_steps == 1 and module.policy_version == 1
    assert module.last_update is not None and module.last_update.policy_version == 1
    theta0, direct = _direct_parameters(make_policy, batch)
    assert not torch.equal(direct, theta0)
    assert float((module.layout.values() - direct).norm() / (direct - theta0).norm()) <= FLOAT64_TOLERANCE


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_trainer_fit_takes_one_step_equal_to_direct_replay(make_policy, teacher64, vocab_size, objective, tmp_path):
    _fit_and_check(StreamingPolicyModule, make_policy, batch_for(objective, vocab_size, teacher64, seed=8), tmp_path)


@pytest.mark.parametrize("through", ["ingest_barrier", "training_step"])
def test_fabric_wrapped_module_takes_one_step_equal_to_direct_replay(make_policy, vocab_size, through):
    batch = grpo_batch(vocab_size, seed=9)
    module = StreamingPolicyModule(make_policy())
    theta0 = module.layout.values()
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric_module, fabric_optimizer = fabric.setup(module, module.configure_optimizers())
    steps = count_steps(fabric_optimizer)
    if through == "ingest_barrier":  # the wrapper forwards ingest/barrier to the original module
        for item in batch.stream():
            fabric_module.ingest(item)
        assert steps[0] == 0 and torch.equal(module.layout.values(), theta0)
        result = fabric_module.barrier(fabric_optimizer)
        assert result.policy_version == 1
    else:  # a Fabric loop: training_step per item, barrier on BatchClosed via self.optimizers()
        # move_to_device=False: Fabric's default device transfer rejects frozen dataclasses, like the Trainer's.
        loader = fabric.setup_dataloaders(DataLoader(list(batch.stream()), batch_size=None), move_to_device=False)
        for index, item in enumerate(loader):
            fabric_module.training_step(item, index)
            if not isinstance(item, BatchClosed):
                assert steps[0] == 0
        assert module.last_update is not None and module.last_update.policy_version == 1
    assert steps[0] == 1 and module.num_optimizer_steps == 1 and module.policy_version == 1
    assert fabric_module.policy_version == 1
    _, direct = _direct_parameters(make_policy, batch)
    assert not torch.equal(direct, theta0)
    assert float((module.layout.values() - direct).norm() / (direct - theta0).norm()) <= FLOAT64_TOLERANCE


# --------------------------------------------------------------------------- 7. optimizer defaults
def test_configure_optimizers_is_table5_adamw(make_policy):
    module = StreamingPolicyModule(make_policy())
    optimizer = module.configure_optimizers()
    assert type(optimizer) is torch.optim.AdamW
    (group,) = optimizer.param_groups
    assert group["lr"] == 1e-6
    assert tuple(group["betas"]) == (0.9, 0.999)
    assert group["eps"] == 1e-8
    assert group["weight_decay"] == 0.0
    assert [id(p) for p in group["params"]] == [id(p) for p in module.layout.parameters]
    assert len(group["params"]) == len([p for p in module.policy.parameters() if p.requires_grad])
    assert module.max_grad_norm == 1.0

    custom = StreamingPolicyModule(make_policy(), optimizer=OptimizerSettings(lr=1e-5, betas=(0.8, 0.9), eps=1e-7))
    (group,) = custom.configure_optimizers().param_groups
    assert (group["lr"], tuple(group["betas"]), group["eps"], group["weight_decay"]) == (1e-5, (0.8, 0.9), 1e-7, 0.0)


# --------------------------------------------------------------------------- 8. the public learner API (issue 17)
def test_float32_direction_norm_is_accumulated_in_float64(make_policy, vocab_size):
    """361,600 float32 entries: a float32 sum is ~1.5e-5 off, which moved actor/grad_norm and the coefficient the
    FSDP2/ZeRO barrier clips with (clip_coefficient(norm)) past the 1e-5 target."""
    module = StreamingPolicyModule(make_policy(torch.float32), max_grad_norm=1e-3)
    assert module.layout.numel == 361_600
    ingest_all(module, grpo_batch(vocab_size).stream())
    result = module.barrier(module.configure_optimizers())
    exact = float(torch.linalg.vector_norm(module.last_direction.double()))
    assert module.last_direction.dtype == torch.float32
    assert abs(result.direction_norm / exact - 1) <= 1e-12
    assert result.clip_coefficient == pytest.approx(1e-3 / (exact + TORCH_CLIP_EPS), rel=1e-6)


def test_lora_on_embed_tokens_streams_the_exact_direction(make_policy, vocab_size):
    """peft's LoRA Embedding layer keeps the nn.Embedding as base_layer (it has no num_embeddings of its own)."""
    from peft import LoraConfig, get_peft_model
    from reference import grpo_direction

    config = LoraConfig(r=2, lora_alpha=4, target_modules=["embed_tokens", "q_proj"], init_lora_weights=False)

    def lora_policy():
        torch.manual_seed(0)  # the same random adapter every time
        return get_peft_model(make_policy(), config)

    batch = grpo_batch(vocab_size)
    directions = {}
    for schedule in SCHEDULES:
        module = StreamingPolicyModule(lora_policy(), schedule=schedule)
        assert any("embed_tokens.lora_embedding" in name for name, _ in module.policy.named_parameters())
        ingest_all(module, batch.stream())
        module.barrier(module.configure_optimizers())
        directions[schedule] = module.last_direction
    reference = grpo_direction(lora_policy(), batch)
    for direction in directions.values():
        assert rel_err(direction, reference) <= FLOAT64_TOLERANCE
    too_large = replace(batch.items[0], token_ids=batch.items[0].token_ids.clone().fill_(vocab_size))
    module = StreamingPolicyModule(lora_policy())
    module.ingest(batch.plan)
    with pytest.raises(SourceError, match=f"vocabulary has {vocab_size} entries"):
        module.ingest(too_large)


def test_named_direction_is_the_ascent_direction_the_optimizer_descends(make_policy, vocab_size):
    """Documented sign convention: .grad = −c·g_k, so SGD(lr=1) moves θ by +c·g_k, parameter by parameter."""
    module = StreamingPolicyModule(make_policy(), max_grad_norm=0.5)
    with pytest.raises(RuntimeError, match="no update has run yet"):
        module.named_direction()
    before = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    ingest_all(module, grpo_batch(vocab_size).stream())
    result = module.barrier(torch.optim.SGD(module.layout.parameters, lr=1.0))
    assert result.clip_coefficient < 1
    direction = module.named_direction()
    assert list(direction) == [name for name, _ in module.policy.named_parameters()]
    for name, p in module.policy.named_parameters():
        torch.testing.assert_close(
            p.detach() - before[name], result.clip_coefficient * direction[name], rtol=0, atol=1e-12
        )
