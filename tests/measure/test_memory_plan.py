"""``tslightning plan``'s per-rank memory against what torch holds in a real learner on CPU, component by component.

The plan is made from the tiny model's config alone (fake tensors); the measurements come from a real float32
policy streaming a GRPO batch: parameter bytes, the most gradient values held at once (one unit: the learner's own
count of what autograd hands its hooks), AdamW's state after the step, the accumulators' peak, and the memory a
forward leaves allocated (torch's profiler, which sees every allocation).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.replay_batches import WorkloadShape, synthetic_grpo_batch
from tslightning.core.shard_layout import ShardLayout
from tslightning.distributed.parameter_placement import placement_for
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.loop.startup import checkpoint_activations
from tslightning.measure.memory_plan import LearnerShape, plan_learner_memory
from tslightning.models.tiny_model import TinyModelConfig, build_tiny_model, build_tokenizer, tiny_qwen2_config

TOKENS = 1024
WITHIN = 0.10


@pytest.fixture(scope="module")
def tiny():
    tokenizer = build_tokenizer()
    return build_tiny_model(TinyModelConfig(seed=0), tokenizer), tiny_qwen2_config(TinyModelConfig(), tokenizer)


def _close(planned: int, measured: int) -> bool:
    return abs(planned - measured) <= WITHIN * measured


def _forward_retained(model: torch.nn.Module, tokens: int) -> int:
    """Bytes a forward (to log-probs) leaves allocated for its backward, from the profiler's memory events."""
    ids = torch.zeros(1, tokens, dtype=torch.long)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), dim=-1)
    del logp
    return sum(event.self_cpu_memory_usage for event in prof.key_averages())


def test_weights_gradients_optimizer_and_statistics_match_a_real_learner(tiny):
    model, config = tiny
    cap = 2
    plan = plan_learner_memory(config, LearnerShape(open_groups=cap, sequence_tokens=TOKENS))
    module = StreamingPolicyModule(model, "grpo", "thundersync", group_admission_cap=cap)
    optimizer = module.configure_optimizers()
    batch = synthetic_grpo_batch(config.vocab_size, 0, torch.Generator().manual_seed(0), WorkloadShape(num_groups=3))
    batch = batch.reordered(torch.Generator().manual_seed(0))  # groups interleave: the cap is reached
    for item in batch.stream():
        module.ingest(item)
    module.barrier(optimizer)
    measured = {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        # the gradient values the learner held at once: the placement's count of what autograd handed its hooks
        "gradients": module.placement.units.peak_live_numel * module.groups.dtype.itemsize,
        "optimizer": sum(
            t.numel() * t.element_size() for state in optimizer.state.values() for k, t in state.items() if k != "step"
        ),
        "statistics": module.last_update.peak_held_numel * module.groups.dtype.itemsize,
    }
    assert module.last_update.peak_held_numel == (2 * cap + 1) * module.layout.numel  # the cap bound (App. D.3)
    for name, value in measured.items():
        assert _close(getattr(plan, name), value), (name, getattr(plan, name), value)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_match_what_a_forward_leaves_allocated(tiny, checkpointing):
    model, config = tiny
    plan = plan_learner_memory(config, LearnerShape(sequence_tokens=TOKENS))
    if checkpointing:
        checkpoint_activations(model)
    try:
        measured = _forward_retained(model, TOKENS)
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
    planned = plan.activations_checkpointed if checkpointing else plan.activations
    print(f"checkpointing={checkpointing}: planned {planned} B, measured {measured} B")
    assert _close(planned, measured)
    assert plan.activations_checkpointed < plan.activations / 2


def test_sharding_lora_and_precision_scale_the_components(tiny):
    _, config = tiny
    full = plan_learner_memory(config, LearnerShape(sequence_tokens=256))
    fsdp = plan_learner_memory(config, LearnerShape(placement=placement_for("fsdp"), world_size=4, sequence_tokens=256))
    assert fsdp.weights == pytest.approx(full.weights / 4, abs=1) and fsdp.optimizer == pytest.approx(
        full.optimizer / 4, abs=1
    )
    assert fsdp.gradients == full.gradients == full.largest_unit * 4  # one gradient unit at a time, whatever the ranks
    assert full.largest_unit < sum(
        p.numel() for p in build_tiny_model(TinyModelConfig(), build_tokenizer()).parameters()
    )
    lora = plan_learner_memory(
        config,
        LearnerShape(precision="bf16-mixed", lora_rank=4, lora_targets=("q_proj", "v_proj"), sequence_tokens=256),
    )
    assert lora.optimizer < full.optimizer / 20 and lora.weights < full.weights  # bf16 base, float32 adapters
    opd = plan_learner_memory(config, LearnerShape(objective="opd", sequence_tokens=256))
    assert opd.statistics == full.optimizer / 2  # one parameter-sized float32 sum


def test_the_plan_says_which_setting_to_change(tiny):
    _, config = tiny
    shape = LearnerShape(open_groups=4, sequence_tokens=4096, statistics_device="device")
    plan = plan_learner_memory(config, shape)
    assert plan.advice(plan.device_bytes(False), shape) == []
    advice = plan.advice(plan.device_bytes(True), shape)
    assert advice[0] == "learner.activation_checkpointing: true" and "learner.statistics_device: host" in advice
    assert "learner.activation_checkpointing: true" not in plan.advice(plan.device_bytes(True) - 1, shape, True)


def test_sharded_statistics_are_each_rank_shard_of_every_ranks_open_groups(tiny):
    """Per rank: (2·k·world + 1) shards, each the ShardLayout the learner's accumulator counts (FSDP2's padded
    dim-0 chunks), where whole statistics are (2k + 1) full vectors."""
    model, config = tiny
    whole_shape = LearnerShape(placement=placement_for("fsdp"), world_size=4, open_groups=2, statistics_device="device")
    whole = plan_learner_memory(config, whole_shape, activations=False)
    shape = LearnerShape(placement=placement_for("fsdp", True), world_size=4, open_groups=2, statistics_device="device")
    sharded = plan_learner_memory(config, shape, activations=False)
    shard = ShardLayout(ParameterLayout(model.parameters()), 4, 0).numel
    assert sharded.statistics == (2 * 2 * 4 + 1) * shard * 4  # float32 statistics
    assert whole.statistics == (2 * 2 + 1) * ParameterLayout(model.parameters()).numel * 4
    assert "1/4 shard" in sharded.table() and "1/4 shard" not in whole.table()
    assert "learner.shard_statistics: true (each rank keeps its shard of G1/G2 and the batch)" in whole.advice(
        1, whole_shape
    )
    assert not any("shard_statistics" in change for change in sharded.advice(1, shape))
    ddp = LearnerShape(placement=placement_for("ddp", True), world_size=4, open_groups=2, statistics_device="device")
    assert plan_learner_memory(config, ddp, activations=False).statistics == whole.statistics  # ddp cannot shard


def test_spread_groups_shard_only_the_groups_open_anywhere(tiny):
    """Groups spread over the ranks (fit under shard_statistics): (2k + 1) shards, k the groups open anywhere."""
    model, config = tiny
    shape = LearnerShape(placement=placement_for("fsdp", True), world_size=4, open_groups=2, statistics_device="device")
    spread_shape = LearnerShape(**{**shape.__dict__, "spread_groups": True})
    spread = plan_learner_memory(config, spread_shape, activations=False)
    shard = ShardLayout(ParameterLayout(model.parameters()), 4, 0).numel
    assert spread.statistics == (2 * 2 + 1) * shard * 4  # float32 statistics
    assert plan_learner_memory(config, shape, activations=False).statistics == (2 * 2 * 4 + 1) * shard * 4
    assert "1/4 shard (groups open anywhere)" in spread.table()
    ddp = LearnerShape(placement=placement_for("ddp", True), world_size=4, open_groups=2, spread_groups=True)
    assert not plan_learner_memory(config, ddp, activations=False).groups_spread  # nothing sharded, nothing spread


def test_a_fold_queue_keeps_its_pending_units_alive_where_the_statistics_are(tiny):
    _, config = tiny
    one = plan_learner_memory(config, LearnerShape(statistics_device="device"), activations=False)
    queued = plan_learner_memory(
        config, LearnerShape(statistics_device="device", fold_queue_depth=2), activations=False
    )
    assert queued.gradients == 3 * one.gradients and queued.statistics == one.statistics
    host = plan_learner_memory(config, LearnerShape(fold_queue_depth=2), activations=False)
    assert host.gradients == one.gradients and host.staging == 2 * 2 ** math.ceil(math.log2(one.gradients))


@pytest.mark.parametrize("sharded", [False, True])
def test_streaming_costs_at_most_its_statistics_over_the_sync_schedule(tiny, sharded):
    """App. D.3: streaming's extra memory over the sync schedule's for the same run is the open groups' statistics,
    at most (2k + 1)·P values per rank, P this rank's shard of the trainable parameters."""
    model, config = tiny
    placement = placement_for("fsdp", shard_statistics=True) if sharded else placement_for("ddp")
    world = 4 if sharded else 1
    shard = (
        ShardLayout(ParameterLayout(model.parameters()), world, 0).numel
        if sharded
        else sum(p.numel() for p in model.parameters())
    )
    for k in (1, 2):
        for where in ("device", "host"):
            common = dict(placement=placement, world_size=world, open_groups=k, spread_groups=sharded)
            stream = plan_learner_memory(config, LearnerShape(**common, statistics_device=where), activations=False)
            sync = plan_learner_memory(
                config, LearnerShape(**common, statistics_device=where, schedule="sync"), activations=False
            )
            extra = stream.statistics - sync.statistics
            assert 0 < extra <= (2 * k + 1) * shard * 4  # float32 statistics
            device_extra = stream.device_bytes(True) - sync.device_bytes(True)
            assert device_extra == (extra if where == "device" else 0)
