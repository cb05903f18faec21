#!/usr/bin/env bash
# Set up tslightning from a fresh clone on a CPU machine: a .venv with the pinned CPU torch and every extra the
# tests need. Idempotent; takes ~2 minutes on a fresh machine. Usage: bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
# The CPU build of torch 2.13.0 (an unpinned torch would pull a multi-GB CUDA build).
.venv/bin/python -m pip install --quiet -c scripts/constraints-cpu.txt torch==2.13.0
.venv/bin/python -m pip install --quiet -c scripts/constraints-cpu.txt -e '.[dev]'
.venv/bin/python -c "import torch, lightning, transformers, peft, tslightning; print('tslightning ready: torch', torch.__version__)"
