#!/usr/bin/env bash
# The staged GPU check (scripts/check_gpu.py has the stages): one JSON per stage under --out (default runs/check_gpu),
# a PASS/FAIL/SKIP line each, exit 1 if any failed. About 8 minutes on one H100/H200.
#   bash scripts/check_gpu.sh                                  # every stage on the GPU
#   bash scripts/check_gpu.sh --stages exactness,collectives   # some of them
#   bash scripts/check_gpu.sh --device cpu --out /tmp/check    # the dry run the test suite runs
# It runs from the source tree on any Python with torch, lightning, transformers and peft (a bare CUDA image): no
# install, no network, no jsonargparse (the stages use the Python API, not the CLI). PYTHON picks the interpreter
# (default: .venv/bin/python if present, else python3). Wheels in TSLIGHTNING_WHEELS (default .whl/) are installed
# into a temporary directory first, for anything else an image lacks (`pip download --no-deps -d .whl NAME==V` on a
# machine with network). vLLM (a 326 MB wheel) and DeepSpeed (built from source) do not fit a carried wheel
# directory: their stages are skipped, saying so, where they are not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
wheels="${TSLIGHTNING_WHEELS:-.whl}"
extra=""
if compgen -G "$wheels/*.whl" >/dev/null; then
  extra="$(mktemp -d /tmp/tslightning-wheels.XXXXXX)"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$extra" "$wheels"/*.whl
fi
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH="$PWD/src${extra:+:$extra}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/check_gpu.py "$@"
