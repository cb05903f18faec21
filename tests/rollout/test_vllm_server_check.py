"""Bad servers are refused before training starts, one line each naming ``rollout.server_urls`` and the fix: an
unreachable URL (in fit's preflight, before anything is written), a server with another model, and servers that lack
what the protocol needs."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tslightning import cli
from tslightning.loop.settings import InvalidSettingsError
from tslightning.models.tiny_model import TinyModelConfig, save_tiny_model
from tslightning.rollout.vllm_server.check import (
    Expected,
    _config_problems,
    reachability_problems,
    server_command,
    server_problems,
    url_problems,
)
from tslightning.rollout.vllm_server.engine import VLLMServerEngine

ROOT = Path(__file__).parents[2]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the probe is: nothing listens there


def test_malformed_urls_are_named():
    assert url_problems(None) == [
        "rollout.server_urls is empty: give the URL of at least one running vLLM server, e.g. '[http://127.0.0.1:8000]'"
    ]
    problems = url_problems(["127.0.0.1:8000", "http://a:1", "http://a:1"])
    assert problems == [
        "rollout.server_urls: '127.0.0.1:8000' is not an http://host:port URL",
        "rollout.server_urls lists a server twice: ['127.0.0.1:8000', 'http://a:1', 'http://a:1']",
    ]


def test_an_unreachable_url_stops_fit_before_anything_is_written(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert reachability_problems([url], timeout_s=5) == [
        f"rollout.server_urls: {url} is unreachable (ConnectionError); start a vLLM server there (README: Rollout "
        "servers) or fix the URL"
    ]
    out = tmp_path / "run"
    arguments = ["fit", "--config", str(ROOT / "configs/quickstart.yaml"), "--rollout.engine", "vllm_server"]
    with pytest.raises(InvalidSettingsError, match=rf"rollout.server_urls: {url} is unreachable"):
        cli.main([*arguments, "--rollout.server_urls", f"[{url}]", "--out_dir", str(out), "--debug"])
    assert not out.exists()


def test_a_server_with_another_model_is_refused(vllm_server, tmp_path):
    other = save_tiny_model(tmp_path / "other", TinyModelConfig(vocab_size=300))  # another tokenizer
    with pytest.raises(ValueError, match=rf"rollout.server_urls: {vllm_server.url} serves another model"):
        VLLMServerEngine([vllm_server.url], other, context_tokens=4096, timeout_s=60)


def test_servers_lacking_what_the_protocol_needs_are_named(vllm_server):
    wanted = Expected(backend="nccl", dtype="bfloat16", context_tokens=10**6, probe_ids=(1,))
    problems = server_problems(vllm_server.url, wanted)
    assert all(problem.startswith(f"rollout.server_urls: {vllm_server.url} ") for problem in problems)
    text = "\n".join(problems)
    assert "runs weight-transfer backend 'tslightning_gloo', rollout.server_transport needs 'nccl'" in text
    assert "serves 4096 tokens of context, a trajectory needs 1000000: start it with --max-model-len" in text
    assert "serves float32, the learner's serving dtype is bfloat16: start it with --dtype bfloat16" in text
    assert "serves another model" in text  # the probe ids (1,) are not what the server's tokenizer makes


def test_a_lora_server_command_serves_runtime_adapters_up_to_the_next_rank_vllm_accepts():
    command, environment = server_command("tiny", 8000, lora_rank=12, cpu=False)
    assert command[command.index("--max-lora-rank") + 1] == "16" and "--enable-lora" in command
    assert environment["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    plain, plain_environment = server_command("tiny", 8000, cpu=False)
    assert "--enable-lora" not in plain and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain_environment


def test_a_cpu_server_prefills_prompts_whole_and_a_gpu_server_in_chunks():
    """vLLM 0.32's CPU runner crashes rewinding the seeded generator of a prompt split over steps (the engine test
    ``test_prompts_over_one_steps_prefill_budget_are_sampled_as_alone`` runs into it otherwise)."""
    cpu, _ = server_command("tiny", 8000, max_model_len=8192, cpu=True)
    assert "--no-enable-chunked-prefill" in cpu and cpu[cpu.index("--max-num-batched-tokens") + 1] == "8192"
    short, _ = server_command("tiny", 8000, max_model_len=1024, cpu=True)
    assert short[short.index("--max-num-batched-tokens") + 1] == "2048"  # vLLM's CPU default, at least
    gpu, _ = server_command("tiny", 8000, cpu=False)
    assert "--no-enable-chunked-prefill" not in gpu and "--max-num-batched-tokens" not in gpu
    mine, _ = server_command("tiny", 8000, cpu=True, extra=["--max-num-batched-tokens", "16384"])
    assert mine[-2:] == ["--max-num-batched-tokens", "16384"]  # last: the user's flag wins


def test_a_cpu_server_with_chunked_prefill_is_refused(vllm_server):
    """What the fixture server reports, with chunked prefill turned on as vLLM's default would have it."""
    import requests

    info = requests.get(f"{vllm_server.url}/server_info", params={"config_format": "json"}, timeout=30).json()
    config = info["vllm_config"]
    assert config["device_config"]["device"] == "cpu" and not config["scheduler_config"]["enable_chunked_prefill"]
    wanted = Expected(backend="tslightning_gloo", dtype="float32", context_tokens=4096, probe_ids=(1,))
    assert _config_problems(vllm_server.url, config, wanted) == []
    config["scheduler_config"]["enable_chunked_prefill"] = True
    assert _config_problems(vllm_server.url, config, wanted) == [
        f"rollout.server_urls: {vllm_server.url} runs on CPU with chunked prefill, where vLLM 0.32 crashes when it "
        "splits a seeded prompt over steps: start it with --no-enable-chunked-prefill --max-num-batched-tokens 4096"
    ]
    config["device_config"]["device"] = "cuda"
    assert _config_problems(vllm_server.url, config, wanted) == []
