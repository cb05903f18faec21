"""Check VLLMRolloutEngine's weight publication on a CUDA GPU: ``pip install -e '.[vllm]'``, then
``python scripts/check_vllm_gpu.py [--dtype bfloat16] [--model CHECKPOINT] [--multiprocess]``.

The learner (HF, float32, on CPU) and the engine (vLLM on the GPU) start from the same checkpoint (default: the tiny
Qwen2). The engine samples a turn from a prompt longer than a KV block, so a stale prefix-cache hit would show; then
``publish`` installs perturbed weights: the served log-probs must match the learner's perturbed model and no longer
the original. Publishing the originals back must restore the first turn exactly. Exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import copy
import pathlib
import sys
import time

import torch

from tslightning.models.tiny_model import CORPUS, load_tiny_model, save_tiny_model
from tslightning.rollout.engine import Generation, GenerationRequest
from tslightning.rollout.vllm_engine import VLLMRolloutEngine


def _gap(generation: Generation, model: torch.nn.Module, prompt: tuple[int, ...]) -> float:
    """Largest |served log-prob - learner log-prob| over the sampled tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(generation.token_ids)])).logits[0, len(prompt) - 1 : -1]
    learner = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(generation.token_ids)[:, None])[:, 0]
    return (torch.tensor(generation.logprobs) - learner).abs().max().item()


def _perturbed(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    copied = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.abs().mean())
    return copied


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF checkpoint directory (default: the tiny Qwen2, saved under --workdir)")
    parser.add_argument("--workdir", default="/tmp/tslightning-vllm-gpu-check")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--atol", type=float, help="log-prob tolerance (default 1e-3 in float32, 0.05 otherwise)")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--multiprocess", action="store_true", help="run vLLM's engine core in its own process")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("No CUDA device: this check is for GPUs (CPU CI runs tests/rollout/test_vllm_engine.py).")
        return 1
    atol = args.atol or (1e-3 if args.dtype == "float32" else 0.05)
    path = args.model or str(save_tiny_model(pathlib.Path(args.workdir) / "tiny"))
    model, tokenizer = load_tiny_model(path)
    prompt = tuple(tokenizer(" ".join(CORPUS[:60]))["input_ids"][:300])
    request = GenerationRequest("check", prompt, 32, seed=0)
    results: list[tuple[str, bool]] = []
    with VLLMRolloutEngine(
        path,
        dtype=args.dtype,
        max_model_len=1024,
        kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30),
        in_process=not args.multiprocess,
    ) as engine:
        before = engine.generate([request], timeout=600)[0]
        start_gap = _gap(before, model, prompt)
        results.append((f"version 0 serves the checkpoint (gap {start_gap:.2e} <= {atol})", start_gap <= atol))

        new_model = _perturbed(model, scale=0.5)
        receipt = engine.publish(new_model.state_dict(), 1)
        after = engine.generate([request], timeout=600)[0]
        new_gap, old_gap = _gap(after, new_model, prompt), _gap(after, model, prompt)
        results.append((f"acknowledged version 1 in {receipt.seconds * 1e3:.1f} ms", engine.policy_version == 1))
        results.append(("generation stamped version 1", after.policy_version == 1))
        results.append((f"new weights serve (gap {new_gap:.2e} <= {atol})", new_gap <= atol))
        results.append((f"old weights no longer serve (gap {old_gap:.2e} > {3 * atol})", old_gap > 3 * atol))

        engine.publish(model.state_dict(), 2)
        restored = engine.generate([request], timeout=600)[0]
        results.append(("publishing the originals restores the first turn", restored.token_ids == before.token_ids))

        batch = [GenerationRequest(f"b{i}", prompt[: 20 + i], 32, seed=i) for i in range(8)]
        engine.generate(batch, timeout=600)
        start = time.perf_counter()
        engine.generate(batch, timeout=600)
        print(f"generate 8x32 tokens: {time.perf_counter() - start:.3f} s")
    for label, ok in results:
        print(f"[{'ok' if ok else 'FAIL'}] {label}")
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
