"""The staged GPU check: does the GPU path work, stage by stage, on this machine? (``bash scripts/check_gpu.sh``)

Stages (``--stages`` picks some, in this order; ``scripts/check_gpu_stages.py`` has each one's contract):

* ``environment``: versions, the device, a bf16 matrix product, its MFU peak, no CLI dependency;
* ``exactness``: ``tslightning verify`` on the device, float64 and float32, GRPO and OPD;
* ``collectives``: tslightning's collectives on two NCCL ranks, then an OOM on one rank mid-pass;
* ``fit``: a few bf16-mixed updates with a checkpoint after each, then a resume;
* ``memory``: a ~1.5B shape's update, its speed and peak memory against ``tslightning plan``;
* ``fsdp``: ``fit`` under FSDP2 on two ranks;
* ``vllm``, ``deepspeed``: when installed, else skipped with the reason.

Each stage runs in its own process with its own time limit (a crash or a hang ends that stage only) and writes
``OUT/<stage>.json``: ``{"stage", "device", "passed", "skipped", "seconds", "checks": [{"check", "pass",
"detail"}], "figures"}``; ``OUT/summary.json`` lists them all. Exit status 1 if any stage failed.

``--device cpu`` runs the same stages as a dry run (gloo and the NCCL stand-in of the tests, smaller shapes): the
test suite runs it, so the check cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_gpu_stages import STAGES  # noqa: E402 - the stages live beside this script

ROOT = Path(__file__).resolve().parents[1]
STAGE_TIMEOUT_S = {"collectives": 420, "fsdp": 420, "vllm": 420}
"""Seconds each stage may take (default 300): the GPU run's budget is about 8 minutes in all."""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of: {', '.join(STAGES)}")
    parser.add_argument("--out", default="runs/check_gpu")
    parser.add_argument("--jobs", type=int, default=1, help="stages run at once (CPU dry run only: a GPU runs one)")
    parser.add_argument("--run-stage", help=argparse.SUPPRESS)  # internal: one stage, in this process
    args = parser.parse_args()
    out = Path(args.out)
    if args.run_stage:
        return run_stage(args.run_stage, args.device, out)
    stages = [name.strip() for name in args.stages.split(",") if name.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"--stages: unknown {unknown}; choose from {list(STAGES)}")
    if args.jobs > 1 and args.device == "cuda":
        parser.error("--jobs: stages share the GPU, run them one at a time on cuda")
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        results = list(pool.map(lambda name: run_isolated(name, args.device, out), stages))
    (out / "summary.json").write_text(json.dumps(results, indent=2))
    for result in results:
        verdict = "SKIP" if result["skipped"] else "PASS" if result["passed"] else "FAIL"
        cpu = f"{result['cpu_seconds']:6.1f} s CPU" if result.get("cpu_seconds") is not None else " " * 12
        print(f"{verdict}  {result['stage']:<12} {result['seconds']:6.1f} s {cpu}  {result['skipped'] or ''}")
    return 0 if all(result["passed"] for result in results) else 1


def run_isolated(name: str, device: str, out: Path) -> dict:
    """Run stage ``name`` in a child process; its JSON, or a failed one holding the end of its output."""
    stage_out = out / name
    shutil.rmtree(stage_out, ignore_errors=True)  # a stage starts from nothing (fit refuses a used out_dir)
    stage_out.mkdir(parents=True)
    (out / f"{name}.json").unlink(missing_ok=True)
    command = [sys.executable, __file__, "--run-stage", name, "--device", device, "--out", str(stage_out)]
    start = time.monotonic()
    limit = STAGE_TIMEOUT_S.get(name, 300)
    with (stage_out / "output.log").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            _, status, usage = os.wait4(process.pid, 0) if _waits_within(process, limit) else (0, -9, None)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    tail = (stage_out / "output.log").read_text(errors="replace")[-4000:]
    if usage is None:
        tail = f"timed out after {limit} s\n{tail}"
    path = out / f"{name}.json"
    if path.exists():
        result = json.loads(path.read_text())
    else:
        check = {"check": "the stage finished and reported", "pass": False, "detail": tail}
        result = {"stage": name, "device": device, "passed": False, "skipped": None, "checks": [check], "figures": {}}
    result["seconds"] = round(time.monotonic() - start, 1)
    result["cpu_seconds"] = None if usage is None else round(usage.ru_utime + usage.ru_stime, 1)  # the stage alone
    path.write_text(json.dumps(result, indent=2))
    print(f"{name}: {'passed' if result['passed'] else 'FAILED'} ({result['seconds']} s)", flush=True)
    for check in result["checks"]:
        print(f"  {'PASS' if check['pass'] else 'FAIL'}  {check['check']}: {check['detail'][:300]}", flush=True)
    return result


def _waits_within(process: subprocess.Popen, limit: float) -> bool:
    """Whether ``process`` exits within ``limit`` seconds (left unreaped, so ``os.wait4`` reads its usage)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(0.2)
    return False


def run_stage(name: str, device: str, out: Path) -> int:
    """The child: run one stage here and write ``<out>/../<name>.json``."""
    try:
        report = STAGES[name](device, out)
        result = {
            "passed": report.passed,
            "skipped": report.skipped,
            "checks": report.checks,
            "figures": report.figures,
        }
    except Exception:
        check = {"check": "the stage ran without an exception", "pass": False, "detail": traceback.format_exc()[-3000:]}
        result = {"passed": False, "skipped": None, "checks": [check], "figures": {}}
    result = {"stage": name, "device": device, **result}
    (out.parent / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
