"""``scripts/check_gpu.py``'s CPU parts: the same bf16-mixed fit and checks on CPU (gloo, the HF engine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_gpu_check_passes_its_cpu_run(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run(
        [sys.executable, "scripts/check_gpu.py", "--accelerator", "cpu", "--engine", "hf", "--out", str(out),
         "--updates", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "check_gpu.json").read_text())
    assert [c["check"] for c in report if not c["pass"]] == []
    assert "PASS  the backend is gloo" in done.stdout and '"world_size": 1' in done.stdout
