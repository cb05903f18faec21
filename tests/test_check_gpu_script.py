"""``scripts/check_gpu.sh``'s dry run: every stage of the GPU check on this CPU (gloo, the NCCL stand-in, small
shapes), so the check cannot rot between the runs a GPU machine gets. About 3 minutes of CPU on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
STAGES = ["environment", "exactness", "collectives", "fit", "memory", "fsdp", "vllm", "deepspeed"]
OPTIONAL = {"vllm", "deepspeed"}  # skipped, saying why, where not installed


def _check(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", str(ROOT / ".venv" / "bin" / "python"))}
    if not Path(env["PYTHON"]).exists():
        env.pop("PYTHON")
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_gpu.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("check_gpu")
    done = _check("--device", "cpu", "--out", str(out), "--jobs", "2", timeout=1500)
    return out, done


def test_every_stage_passes_its_cpu_dry_run(dry_run):
    out, done = dry_run
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [result["stage"] for result in summary] == STAGES
    for result in summary:
        stage = json.loads((out / f"{result['stage']}.json").read_text())
        assert stage == result and stage["device"] == "cpu" and stage["passed"], stage
        if stage["skipped"]:
            assert stage["stage"] in OPTIONAL and "not installed" in stage["skipped"]
            continue
        assert stage["checks"] and all(check["pass"] for check in stage["checks"]), stage["checks"]
        assert stage["cpu_seconds"] > 0
        assert f"PASS  {stage['stage']}" in done.stdout


def test_the_dry_run_ran_the_real_paths(dry_run):
    out, _ = dry_run
    collectives = json.loads((out / "collectives.json").read_text())
    assert {"the default group is the NCCL stand-in (or gloo)", "lock-step status exchange"} <= {
        check["check"] for check in collectives["checks"]
    }
    assert all(collectives["figures"][f"rank{r}_failure_s"] < 30 for r in (0, 1))  # the OOM heard within seconds
    exactness = json.loads((out / "exactness.json").read_text())
    assert exactness["figures"]["grpo_float64"]["first_direction_rel_error"] <= 1e-10
    fit = json.loads((out / "fit.json").read_text())
    assert len(fit["figures"]["step_seconds"]) == 2 and fit["figures"]["mfu"] == []  # a CPU logs no MFU
    assert (out / "fit" / "run" / "checkpoints").is_dir()


def test_a_stage_that_fails_is_reported_and_fails_the_check(tmp_path):
    """On a machine without CUDA the GPU environment stage must fail, not pass vacuously."""
    done = _check("--device", "cuda", "--stages", "environment", "--out", str(tmp_path), timeout=600)
    assert done.returncode == 1, done.stdout[-3000:]
    stage = json.loads((tmp_path / "environment.json").read_text())
    assert not stage["passed"] and stage["checks"][0] == {
        "check": "CUDA is available",
        "pass": False,
        "detail": "0 device(s)",
    }
    assert "FAIL  environment" in done.stdout
    unknown = _check("--stages", "nothing", "--out", str(tmp_path), timeout=120)
    assert unknown.returncode == 2 and "--stages: unknown ['nothing']" in unknown.stderr
