"""What a rank holds of gradients and statistics while it streams: one gradient unit, not the source's whole gradient
(issue 24), measured on 2 gloo ranks under FSDP2 with sharded statistics on a 12-layer policy, against the plan.

Method (the learner's own accounting, stated): every gradient tensor autograd hands the placement's hooks is counted
until the unit it belongs to is folded (:attr:`UnitBackward.peak_live_numel`); a unit's exchange adds the rows it
sends and the rows it receives (:attr:`StatisticsShards.peak_exchange_numel`: the most values one exchange held at
once); the statistics' own count of held values gives theirs (:attr:`UpdateResult.peak_held_numel`). "Before" is the
same code with the whole model as one gradient unit — what the learner held before it folded by units: the whole
gradient of a source, scattered whole into rows, received whole.
"""

from __future__ import annotations

import pytest
import torch
from multirank_cases import DEEP_LAYERS, run_case
from test_multirank import _launch, _load, _rel

from tslightning.distributed.parameter_placement import placement_for
from tslightning.measure.memory_plan import LearnerShape, plan_learner_memory
from tslightning.models.tiny_model import TinyModelConfig, build_tokenizer, tiny_qwen2_config

UNITS = "grpo-thundersync-sharded-spread-deep-cap1-grpo"
WHOLE = "grpo-thundersync-sharded-spread-deep-cap1-whole-grpo"
WITHIN = 0.10


@pytest.fixture(scope="module")
def memory_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("unit-memory")
    done = _launch(out, "fsdp", UNITS, WHOLE, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _plan():
    config = tiny_qwen2_config(TinyModelConfig(num_hidden_layers=DEEP_LAYERS), build_tokenizer())
    shape = LearnerShape(
        precision="64-true",
        placement=placement_for("fsdp", shard_statistics=True),
        world_size=2,
        open_groups=1,
        spread_groups=True,
        statistics_device="device",
    )
    return plan_learner_memory(config, shape, activations=False)


def test_a_rank_holds_one_unit_of_gradient_and_the_plan_predicts_it(memory_run):
    plan = _plan()
    for rank in (0, 1):
        units, whole = (_load(memory_run, "fsdp", case, rank) for case in (UNITS, WHOLE))
        gradients = units["peak_exchange_numel"] * 8  # float64
        before = whole["peak_exchange_numel"] * 8
        statistics = max(peak for peak, _, _ in units["held"]) * 8
        print(
            f"rank {rank}: gradients {gradients} B (before: {before} B), statistics {statistics} B; "
            f"plan {plan.gradients} B and {plan.statistics} B"
        )
        assert abs(plan.gradients - gradients) <= WITHIN * gradients
        assert abs(plan.statistics - statistics) <= WITHIN * statistics
        assert before > 5 * gradients  # 12 blocks: the whole gradient is many units
        assert units["peak_unit_numel"] == plan.largest_unit  # the largest unit, never two at once


def test_folding_by_units_is_the_sync_update(memory_run):
    """The deep policy's streamed update, by units and whole, equals the single-process sync replay (float64)."""
    replay = run_case("grpo-sync-deep-grpo", None, torch.float64)
    for case in (UNITS, WHOLE):
        for rank in (0, 1):
            record = _load(memory_run, "fsdp", case, rank)
            for k in range(len(replay["directions"])):
                assert _rel(record["directions"][k], replay["directions"][k]) <= 1e-12
                moved = (replay["thetas"][k] - replay["theta0"]).norm()
                assert float((record["thetas"][k] - replay["thetas"][k]).norm() / moved) <= 1e-12
