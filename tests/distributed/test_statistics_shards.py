"""GRPO statistics sharded like FSDP2's parameters (``shard_statistics``), 2 CPU ranks over gloo, float64.

One launch of ``multirank_cases.py`` under ``fsdp`` runs the whole-statistics FSDP2 update and the sharded one for
each advantage estimator, on a policy whose MLP width (255) makes FSDP2 pad its shards; each rank streams its share
in its own random order. The references are the whole-statistics run and the single-process sync replay.
"""

from __future__ import annotations

import math

import pytest
import torch
from multirank_cases import make_policy, run_case
from test_multirank import _launch, _load, _rel

from tslightning.core.batch_registry import BatchPlan
from tslightning.learner.streaming_module import StreamingPolicyModule

ESTIMATORS = ["grpo", "grpo_sample", "dr_grpo", "rloo"]
TOLERANCE = 1e-12
"""Relative error of directions and parameter gaps, float64 (issue 24: ≤ 1e-12 for every placement)."""
SHARDED = [f"grpo-thundersync-sharded-odd-{e}" for e in ESTIMATORS] + [
    "grpo-sync-sharded-odd-grpo",
    "grpo-thundersync-sharded-odd-cap1-grpo",
]
SPREAD = [f"grpo-thundersync-sharded-spread-odd-{e}" for e in ESTIMATORS] + [
    "grpo-sync-sharded-spread-odd-grpo",
    "grpo-thundersync-sharded-spread-odd-cap1-grpo",
]
"""GRPO groups dealt over both ranks by trajectory (``-spread``): the ranks work on the same groups at once."""
OPD_SHARDED = ["opd-thundersync-sharded-odd", "opd-sync-sharded-odd", "opd-thundersync-sharded-odd-queue"]
"""OPD's one sum sharded the same way; ``-queue``: units folded on the folding thread (``fold_queue_depth=2``)."""
QUEUED = "grpo-thundersync-sharded-spread-odd-queue-grpo"
LORA = ["grpo-thundersync-sharded-spread-lora-grpo", "opd-thundersync-sharded-lora"]
"""LoRA adapters under FSDP2 (adapter layers as units of their own), statistics over the adapters only."""
WHOLE = "grpo-thundersync-odd-grpo"
WHOLE_CAPPED = "grpo-thundersync-odd-cap1-grpo"
"""Whole statistics under lock-step with an admission cap: a released group closes after its queued folds."""


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    cases = [WHOLE, WHOLE_CAPPED, *SHARDED, *SPREAD, *OPD_SHARDED, QUEUED, *LORA, "fail-pass-sharded"]
    done = _launch(out, "fsdp", *cases, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _shard_numel(world_size: int) -> tuple[int, int]:
    """(values per rank's shard, padding over all ranks) of the odd policy, from torch.chunk as FSDP2 splits."""
    shard, padding = 0, 0
    for p in make_policy(torch.float64, 255).parameters():
        rows, row = p.shape[0], p[0].numel()
        chunk = math.ceil(rows / world_size)
        shard += chunk * row
        padding += (chunk * world_size - rows) * row
    return shard, padding


def _replay(case: str) -> dict:
    """The single-process sync replay with the case's estimator."""
    return run_case(f"grpo-sync-odd-{case.rsplit('-', 1)[1]}", None, torch.float64)


@pytest.mark.parametrize("case", [*SHARDED, *SPREAD, WHOLE_CAPPED])
def test_the_update_equals_the_sync_replay(fsdp_run, case):
    """Sharded statistics (every estimator, sync too, under a cap) and whole ones under a cap: the sync replay."""
    ranks = [_load(fsdp_run, "fsdp", case, r) for r in (0, 1)]
    replay = _replay(case)
    for k in range(len(replay["directions"])):
        for record in ranks:  # the shards every rank gathered: the whole g_k
            assert record["directions"][k].abs().sum() > 0
            assert _rel(record["directions"][k], replay["directions"][k]) <= TOLERANCE
        assert torch.equal(ranks[0]["thetas"][k], ranks[1]["thetas"][k])
        moved = (replay["thetas"][k] - replay["theta0"]).norm()
        assert moved > 0
        assert float((ranks[0]["thetas"][k] - replay["thetas"][k]).norm() / moved) <= TOLERANCE
    if "thundersync" in case:
        assert sum(idle for r in ranks for _, idle, _ in r["lockstep"]) > 0  # exchanges paired with idle passes


@pytest.mark.parametrize("case", [*OPD_SHARDED, QUEUED, *LORA])
def test_opd_lora_and_background_folds_give_the_sync_replay(fsdp_run, case):
    """OPD's sum sharded like GRPO's statistics, LoRA adapters as FSDP2 units, and units folded on the folding
    thread: the single-process sync update."""
    variant = "-lora" if "lora" in case else "-odd"
    replay = run_case(case.split("-")[0] + "-sync" + variant + ("-grpo" if case.startswith("grpo") else ""), None)
    for record in (_load(fsdp_run, "fsdp", case, r) for r in (0, 1)):
        for k in range(len(replay["directions"])):
            assert _rel(record["directions"][k], replay["directions"][k]) <= TOLERANCE
            moved = (replay["thetas"][k] - replay["theta0"]).norm()
            assert float((record["thetas"][k] - replay["thetas"][k]).norm() / moved) <= TOLERANCE


def test_sharded_statistics_give_the_whole_statistics_fsdp2_update(fsdp_run):
    whole = _load(fsdp_run, "fsdp", WHOLE, 0)
    sharded = _load(fsdp_run, "fsdp", "grpo-thundersync-sharded-odd-grpo", 0)
    for k in range(len(whole["directions"])):
        assert _rel(sharded["directions"][k], whole["directions"][k]) <= TOLERANCE
        moved = (whole["thetas"][k] - whole["theta0"]).norm()
        assert float((sharded["thetas"][k] - whole["thetas"][k]).norm() / moved) <= TOLERANCE


def test_each_rank_holds_its_shard_of_every_statistic(fsdp_run):
    """Held values, from the accumulator's own accounting: (2·open + 1) shards of numel/world (+ FSDP2's padding)."""
    shard, padding = _shard_numel(2)
    assert padding > 0  # the odd MLP width pads (gate and up projections: 255 rows on 2 ranks)
    whole = [_load(fsdp_run, "fsdp", WHOLE, r) for r in (0, 1)]
    for case in SHARDED:
        for rank in (0, 1):
            for k, (peak, shard_numel, numel) in enumerate(_load(fsdp_run, "fsdp", case, rank)["held"]):
                assert shard_numel == shard and 2 * shard_numel == numel + padding
                open_groups, rest = divmod(peak - shard_numel, 2 * shard_numel)
                assert rest == 0 and 0 <= open_groups <= 5  # 5 groups per logical batch, over both ranks
                if "thundersync" in case:  # the same streams: open groups here are both ranks' open groups there
                    whole_open = [(r["held"][k][0] // numel - 1) // 2 for r in whole]
                    assert 1 <= open_groups <= sum(whole_open)
                if "cap1" in case:  # one group per rank: 2·2 + 1 shards, fewer values than 2·1 + 1 whole vectors
                    assert open_groups <= 2 and peak < 3 * numel


def test_spread_groups_hold_the_globally_open_groups_only(fsdp_run):
    """Spread, both ranks' shards hold the same open groups: (2·open_global + 1) shards with open_global <= cap."""
    shard, _ = _shard_numel(2)
    for case in SPREAD:
        for rank in (0, 1):
            record = _load(fsdp_run, "fsdp", case, rank)
            for k, (peak, shard_numel, numel) in enumerate(record["held"]):
                assert all(n > 0 for n in record["units_per_rank"][k])  # every rank serves trajectories
                open_groups, rest = divmod(peak - shard_numel, 2 * shard_numel)
                assert rest == 0 and 0 <= open_groups <= 5
                if "cap1" in case:  # one group open anywhere: (2·1 + 1)·numel/W, not (2·1·W + 1)·numel/W
                    assert open_groups == 1 and peak == 3 * shard < 2 * numel
                elif "thundersync" in case:
                    assert open_groups >= 1


def test_shard_statistics_refuses_parameters_fsdp2_does_not_shard():
    module = StreamingPolicyModule(make_policy(torch.float64), shard_statistics=True)
    plan = BatchPlan("grpo", 0, {"g": 2})
    with pytest.raises(ValueError, match=r"learner.shard_statistics needs FSDP2 parameter shards"):
        module.begin_batch(plan)
    assert module.registry is None  # nothing opened


def test_shard_statistics_refuses_the_boundary_context_backward():
    with pytest.raises(ValueError, match="shard_statistics folds each pass at its lock-step exchange"):
        StreamingPolicyModule(make_policy(torch.float64), shard_statistics=True, context_backward="boundary")


def test_a_pass_that_fails_mid_backward_fails_the_update_on_every_rank(fsdp_run):
    """The failed pass still completes its remaining unit exchanges (sending zeros), so the peers hear the failure
    at their next tick instead of waiting for the timeout, and no rank steps."""
    for rank in (0, 1):
        record = _load(fsdp_run, "fsdp", "fail-pass-sharded", rank)
        assert record["error_type"] == "RankFailureError", record
        assert "update 0 failed on learner rank(s) [1] of 2" in record["error"]
        assert record["unchanged"] and record["policy_version"] == 0
        assert record["seconds"] < 20  # not the 30 s process group timeout
