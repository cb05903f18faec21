"""Sharded GPU-clock checkpoints on 2 gloo ranks: a run killed after update 1 and resumed in a new process
ends with the uninterrupted run's parameters, bit for bit — FSDP2 in float64, DeepSpeed ZeRO-2 and ZeRO-3 in
float32; FSDP2's checkpoint also resumes on 1 rank (resharded), DeepSpeed's only on the process count that wrote it.

Each strategy launches ``resume_cases.py`` twice (Fabric re-runs the command line for rank 1): the uninterrupted run,
which checkpoints every update, then a new process that restores its ``update-1`` (what a run killed between updates
1 and 2 left) with ``fit``'s ``resume_from`` and runs updates 2 and 3 on the same recorded batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from multirank_cases import DTYPES, make_policy
from resume_cases import RESUME_AFTER, UPDATES

from tslightning.callbacks.checkpoint_layout import consolidated_module_state
from tslightning.callbacks.checkpoint_state import CheckpointError, policy_hash, read_meta, restore_checkpoint
from tslightning.distributed.learner_strategy import LearnerSettings, learner_strategy
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.loop.resume import unreadable_checkpoint

SHARDS = {
    "fsdp": ["__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"],
    "deepspeed_stage_3": [f"checkpoint/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)] + ["latest"],
    "deepspeed_stage_2": [f"checkpoint/zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)] + ["latest"],
}
"""What every rank (and the coordinator) wrote into ``state.pt``: one shard per rank."""


def _launch(out: Path, strategy: str, phase: str) -> None:
    """One phase of ``resume_cases.py`` (2 ranks; ``resumed-one-rank``: 1)."""
    script = Path(__file__).with_name("resume_cases.py")
    pythonpath = os.pathsep.join(filter(None, [str(script.parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script), str(out), strategy, phase],
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _ranks(out: Path, strategy: str, phase: str, ranks: int = 2) -> list[dict]:
    records = [torch.load(out / strategy / phase / f"rank{r}.pt", weights_only=False) for r in range(ranks)]
    for record in records:
        assert "crash" not in record, record.get("crash")
    return records


@pytest.fixture(scope="module", params=["fsdp", "deepspeed_stage_3", "deepspeed_stage_2"])
def runs(request, tmp_path_factory):
    """The uninterrupted run and the resumed one of a strategy: ``(out, strategy)``."""
    if request.param.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp(request.param)
    _launch(out, request.param, "straight")
    _launch(out, request.param, "resumed")
    if request.param == "fsdp":
        _launch(out, request.param, "resumed-one-rank")
    return out, request.param


def test_killed_and_resumed_run_equals_the_uninterrupted_one_bit_for_bit(runs):
    out, strategy = runs
    straight, resumed = _ranks(out, strategy, "straight"), _ranks(out, strategy, "resumed")
    assert all(r["thetas"][0].dtype == torch.float64 for r in straight)  # full_values: float64 copies
    theta = straight[0]["thetas"][RESUME_AFTER]
    for record in resumed:
        assert record["first"] == RESUME_AFTER + 1
        assert not torch.equal(record["theta0"], theta)  # it had to restore
        assert torch.equal(record["restored"], theta)
        ((version, published),) = record["published"]  # each rank's engine got the full restored θ, once
        served = StreamingPolicyModule(make_policy(DTYPES[strategy]), "grpo", "thundersync")
        served.policy.load_state_dict(published)
        assert version == RESUME_AFTER + 1 and torch.equal(served.layout.values(), theta)
    for k in range(RESUME_AFTER + 1, UPDATES):
        assert float((straight[0]["thetas"][k] - straight[0]["thetas"][k - 1]).norm()) > 0  # the update moved θ
        for rank in (0, 1):  # AdamW moments and step counts restored too: a fresh optimizer would step differently
            assert torch.equal(resumed[rank]["thetas"][k], straight[rank]["thetas"][k]), (strategy, k, rank)


def test_every_rank_writes_its_shards_and_the_hash_is_of_the_full_weights(runs):
    out, strategy = runs
    root = out / strategy
    checkpoint = root / "straight" / "checkpoints" / f"update-{RESUME_AFTER}"
    meta = read_meta(checkpoint)
    assert (meta["layout"], meta["world_size"]) == (strategy, 2)
    assert all((checkpoint / "state.pt" / name).is_file() for name in SHARDS[strategy])
    assert sorted(p.name for p in (root / "straight" / "checkpoints").iterdir()) == [f"update-{k}" for k in range(4)]

    dtype = DTYPES[strategy]  # the unsharded θ_1, hashed in this one process, is what the ranks hashed together
    module = StreamingPolicyModule(make_policy(dtype), "grpo", "thundersync")
    with torch.no_grad():
        theta = _ranks(out, strategy, "straight")[0]["thetas"][RESUME_AFTER]
        for parameter, value in zip(module.layout.parameters, module.layout.unflatten(theta), strict=True):
            parameter.copy_(value.to(dtype))
    assert policy_hash(module.policy) == meta["policy_hash"]
    last = f"update-{UPDATES - 1}"
    assert (
        read_meta(root / "resumed" / "checkpoints" / last)["policy_hash"]
        == read_meta(root / "straight" / "checkpoints" / last)["policy_hash"]
    )


def test_fsdp2_resumes_on_another_process_count(runs):
    """torch.distributed.checkpoint reshards FSDP2's state onto the ranks that load it: the 2-rank checkpoint resumed
    on 1 rank continues the uninterrupted 2-rank run (float64: the same update, summed in another order)."""
    out, strategy = runs
    if strategy != "fsdp":
        pytest.skip("DeepSpeed checkpoints resume on the process count that wrote them")
    straight = _ranks(out, strategy, "straight")[0]
    (one_rank,) = _ranks(out, strategy, "resumed-one-rank", ranks=1)
    assert one_rank["first"] == RESUME_AFTER + 1 and torch.equal(one_rank["restored"], straight["thetas"][RESUME_AFTER])
    for k in range(RESUME_AFTER + 1, UPDATES):
        step = (straight["thetas"][k] - straight["thetas"][k - 1]).norm()
        assert float((one_rank["thetas"][k] - straight["thetas"][k]).norm() / step) <= 1e-10, k
    checkpoint = out / strategy / "straight" / "checkpoints" / f"update-{RESUME_AFTER}"
    for devices in (1, 2, 4):  # fit's preflight takes it on any process count; another strategy is refused
        assert unreadable_checkpoint(str(checkpoint), LearnerSettings(devices=devices, strategy=strategy)) == []
    (other_strategy,) = unreadable_checkpoint(str(checkpoint), LearnerSettings(devices=2, strategy="ddp"))
    assert "written in the 'fsdp' layout and this run writes 'replicated'; resume with learner.strategy fsdp" in (
        other_strategy
    )


def test_a_deepspeed_checkpoint_refuses_another_process_count_or_strategy(runs):
    out, strategy = runs
    if strategy == "fsdp":
        pytest.skip("FSDP2 checkpoints reshard (test_fsdp2_resumes_on_another_process_count)")
    checkpoint = out / strategy / "straight" / "checkpoints" / f"update-{RESUME_AFTER}"
    assert unreadable_checkpoint(str(checkpoint), LearnerSettings(devices=2, strategy=strategy)) == []
    (other_count,) = unreadable_checkpoint(str(checkpoint), LearnerSettings(devices=4, strategy=strategy))
    assert f"shards are for 2 ranks and this run has 4; resume with learner.strategy {strategy} on 2" in other_count
    assert "learner.devices" in other_count and "\n" not in other_count
    (other_strategy,) = unreadable_checkpoint(str(checkpoint), LearnerSettings(devices=2, strategy="fsdp"))
    assert f"written in the '{strategy}' layout and this run writes 'fsdp'" in other_strategy
    # restore_checkpoint itself (outside fit) refuses before loading anything
    fabric = SimpleNamespace(strategy=learner_strategy(LearnerSettings(devices=1, strategy=strategy), "cpu"))
    fabric.world_size = 1
    module = StreamingPolicyModule(make_policy(DTYPES[strategy]), "grpo", "thundersync")
    with pytest.raises(CheckpointError, match="shards are for 2 ranks and this run has 1"):
        restore_checkpoint(checkpoint, module, [], fabric=fabric)


def test_a_sharded_checkpoint_reads_back_whole_in_one_process(runs):
    """What `tslightning validate` exports: the shards of both ranks joined without a process group."""
    out, strategy = runs
    checkpoint = out / strategy / "straight" / "checkpoints" / f"update-{RESUME_AFTER}"
    state = consolidated_module_state(checkpoint / "state.pt", strategy)
    module = StreamingPolicyModule(make_policy(DTYPES[strategy]), "grpo", "thundersync")
    module.load_state_dict(state, strict=True)
    assert torch.equal(module.layout.values(), _ranks(out, strategy, "straight")[0]["thetas"][RESUME_AFTER])
