#!/usr/bin/env bash
# The one-GPU check of the learner path (issue: multi-rank and GPU learner path). On a CUDA machine, from a clone:
#   python3 -m venv .venv && .venv/bin/pip install -e '.[vllm]' && bash scripts/check_gpu.sh
# Prints PASS/FAIL lines (bf16-mixed fit of 3 updates, vLLM on CUDA, one-rank NCCL group, plan vs measured peak) and
# exits 1 if any check fails. About 5 minutes on one GPU; bounded at 10.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
"$PYTHON" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'vllm', vllm.__version__)"
timeout 600 "$PYTHON" scripts/check_gpu.py --accelerator cuda --engine vllm --out runs/check_gpu "$@"
"$PYTHON" -m tslightning.cli plan --config quickstart --gpu_memory_gb "$("$PYTHON" -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)')"
