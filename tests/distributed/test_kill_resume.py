"""Acceptance : ``tslightning fit`` on 2 gloo ranks, SIGKILLed between updates as a
preempted job is, resumed with ``--resume`` from the CLI, ends with the uninterrupted run's parameters.

Each strategy runs the command until ``update-1`` is on disk, then kills the whole process group (``kill -9``, no
clean-up of any kind), then resumes from ``update-1`` for the last update; both record their batches (rollouts
themselves are not bitwise reproducible: the rollout pool batches turns by arrival). The uninterrupted run on those
same recorded batches is ``fit --replay_batches`` on the same strategy and 2 ranks from the run's ``policy-0``: the
resumed θ must equal it **bitwise** (every tensor; neither Fabric's ModelParallelStrategy nor DeepSpeed has a
float64 precision, so this is float32). The resumed θ must also equal the batch-synchronous replay of the union of
both ranks' batches in one process relative to the step (Eq. 30, ≤ 1e-4 as the other float32 multi-rank tests): the
streamed, sharded update is the synchronous one. Nothing may be counted twice or lost across the kill.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from recorded_replay import assert_float32_run_is_sync

from tslightning.callbacks.checkpoint_layout import consolidated_module_state
from tslightning.models.tiny_model import load_tiny_model

STRATEGIES = ("fsdp",)
"""A sharded layout killed and resumed through ``fit`` itself; ZeRO-2 and ZeRO-3 resume bit for bit in
``test_sharded_resume.py`` (the same checkpoint code, without a whole ``fit`` per run)."""
UPDATES = 3
KILL_AFTER = 1
"""The run is killed once ``update-<KILL_AFTER>`` has been renamed into place (checkpoints are atomic)."""
RUN_TIMEOUT_S = 400


def _command(out: Path, strategy: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tslightning.cli",
        "fit",
        "--config",
        "quickstart",
        f"--updates={UPDATES}",
        f"--out_dir={out}",
        "--progress=false",
        "--learner.devices=2",
        f"--learner.strategy={strategy}",
        "--model.precision=32-true",
        "--record_batches=true",
        "--checkpoint.interval_s=1e-9",  # every update: any positive GPU-clock is past the interval
        "--rollout.prompts_per_update=2",
        "--rollout.samples_per_prompt=4",
        *extra,
    ]


def _environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(out: Path, strategy: str, *extra: str) -> None:
    done = subprocess.run(
        _command(out, strategy, *extra), env=_environment(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _run_and_kill(out: Path, strategy: str) -> None:
    """Start the run in its own process group and SIGKILL the whole group once ``update-KILL_AFTER`` exists."""
    log = (out.parent / f"{out.name}.log").open("w")
    process = subprocess.Popen(
        _command(out, strategy), env=_environment(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    checkpoint = out / "checkpoints" / f"update-{KILL_AFTER}"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not checkpoint.is_dir() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):  # it ended on its own: the assertion below shows why
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        log.close()
    assert checkpoint.is_dir(), (out.parent / f"{out.name}.log").read_text()[-3000:]


def _final(out: Path, update: int = UPDATES - 1) -> tuple[dict[str, torch.Tensor], dict]:
    directory = out / "checkpoints" / f"update-{update}"
    meta = json.loads((directory / "meta.json").read_text())
    state = consolidated_module_state(directory / "state.pt", meta["layout"])
    return {name.split("policy.", 1)[-1]: tensor for name, tensor in state.items()}, meta  # the module's `policy.`


def _replay(run: Path, out: Path, strategy: str) -> None:
    """The uninterrupted run on ``run``'s recorded batches: ``fit --replay_batches`` on the same strategy and ranks,
    from ``run``'s θ_0 (its ``policy-0``, no warm start of its own)."""
    theta0 = [f"--model.path={run / 'policy-0'}", "--warm_start.steps=0"]
    _run(out, strategy, f"--replay_batches={run / 'batches'}", *theta0, "--record_batches=false")


def _differing(theta: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """Tensors not bitwise equal, with their largest absolute difference."""
    return {
        name: float((theta[name].double() - reference[name].double()).abs().max())
        for name in reference
        if not torch.equal(theta[name], reference[name])
    }


def _first_divergence(run: Path, replay: Path) -> str:
    """The first checkpointed update at which ``run`` and ``replay`` differ (where to look when they do)."""
    for update in range(UPDATES):
        if (run / "checkpoints" / f"update-{update}").is_dir():
            differing = _differing(_final(run, update)[0], _final(replay, update)[0])
            if differing:
                worst = max(differing, key=differing.get)
                where = f"max |Δ| {differing[worst]:.3e} in {worst}"
                return f"first differs after update {update}: {len(differing)} tensor(s), {where}"
    return "no checkpoint differs"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_killed_two_rank_fit_resumes_to_the_uninterrupted_parameters(tmp_path, strategy):
    out = tmp_path / "run"
    _run_and_kill(out, strategy)
    written = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("update-"))
    assert written[-1] == f"update-{KILL_AFTER}", written
    _run(out, strategy, f"--resume={out / 'checkpoints' / f'update-{KILL_AFTER}'}")

    theta, meta = _final(out)
    assert meta["layout"] == strategy and meta["world_size"] == 2
    assert meta["policy_version"] == UPDATES and meta["trajectories_seen"] == UPDATES * 2 * 4  # none twice, none lost
    replay = tmp_path / "replay"
    _replay(out, replay, strategy)
    initial_run, _ = load_tiny_model(out / "policy-0")
    initial_replay, _ = load_tiny_model(replay / "policy-0")
    for name, tensor in initial_run.state_dict().items():  # the same θ_0
        assert torch.equal(initial_replay.state_dict()[name], tensor), name
    uninterrupted, replay_meta = _final(replay)
    assert replay_meta["policy_version"] == UPDATES and replay_meta["trajectories_seen"] == meta["trajectories_seen"]
    assert uninterrupted.keys() == theta.keys()
    assert not _differing(theta, uninterrupted), f"{strategy}: {_first_divergence(out, replay)}"

    gap = assert_float32_run_is_sync(theta, out, UPDATES)
    print(f"\n{strategy}: relative gap to the uninterrupted sync replay {gap:.3e}")
