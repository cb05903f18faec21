"""``rollout.speculative``: the settings, the vLLM config they become, and the server comparison that refuses a server
sampling otherwise than the run."""

from __future__ import annotations

import json

import pytest

from tslightning.rollout.speculative import SpeculationStats, SpeculativeSettings, speculative_problems
from tslightning.rollout.vllm_server.check import server_command

URL = "http://127.0.0.1:8000"


def served(settings: SpeculativeSettings | None, **changes) -> dict:
    """A ``/server_info`` ``vllm_config`` as a server started with ``settings`` reports it (vLLM 0.32's keys)."""
    config: dict = {"observability_config": {"per_request_spec_decode_metrics": "summary"}}
    if settings is not None:
        spec = {
            "method": settings.method,
            "num_speculative_tokens": settings.num_speculative_tokens,
            "prompt_lookup_max": settings.prompt_lookup_max if settings.method == "ngram" else None,
            "prompt_lookup_min": settings.prompt_lookup_min if settings.method == "ngram" else None,
            "num_speculative_tokens_per_batch_size": settings.batch_size_schedule(),
            "rejection_sample_method": "standard",
            "model": settings.method,
        }
        config["speculative_config"] = spec | changes
    return config


def test_the_vllm_config_gates_speculation_on_the_tail():
    settings = SpeculativeSettings(num_speculative_tokens=3, max_running_sequences=2)
    assert settings.vllm_config() == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
        "num_speculative_tokens_per_batch_size": [[1, 2, 3], [3, 3, 0]],
    }
    always = SpeculativeSettings(method="suffix", max_running_sequences=None).vllm_config()
    assert always == {"method": "suffix", "num_speculative_tokens": 4}


def test_the_server_command_carries_the_settings_and_acceptance_counts():
    settings = SpeculativeSettings(max_running_sequences=8)
    command, _ = server_command("/m", 8000, cpu=True, speculative=settings)
    flag = command.index("--speculative-config")
    assert json.loads(command[flag + 1]) == settings.vllm_config()
    assert command[command.index("--per-request-spec-decode-metrics") + 1] == "summary"
    assert "--speculative-config" not in server_command("/m", 8000, cpu=True)[0]


@pytest.mark.parametrize(
    ("settings", "problem"),
    [
        (SpeculativeSettings(num_speculative_tokens=0), "rollout.speculative.num_speculative_tokens must be >= 1"),
        (SpeculativeSettings(prompt_lookup_min=5), "rollout.speculative.prompt_lookup_min and prompt_lookup_max"),
        (SpeculativeSettings(max_running_sequences=0), "rollout.speculative.max_running_sequences must be >= 1"),
    ],
)
def test_settings_out_of_range_name_the_key(settings, problem):
    (found,) = settings.problems()
    assert found.startswith(problem)


def test_a_server_speculating_like_the_run_passes():
    settings = SpeculativeSettings()
    assert speculative_problems(URL, served(settings), settings) == []
    assert speculative_problems(URL, served(None), None) == []


def test_each_difference_is_one_line_naming_the_fix():
    settings = SpeculativeSettings()
    (other_k,) = speculative_problems(URL, served(settings, num_speculative_tokens=2), settings)
    assert "num_speculative_tokens 2 (run: 4)" in other_k and "--speculative-config" in other_k
    (ungated,) = speculative_problems(URL, served(settings, num_speculative_tokens_per_batch_size=None), settings)
    assert "batch-size schedule None" in ungated
    (lossy,) = speculative_problems(URL, served(settings, rejection_sample_method="synthetic"), settings)
    assert "'synthetic' rejection sampling" in lossy and "does not keep the policy's distribution" in lossy
    (missing,) = speculative_problems(URL, served(None), settings)
    assert "runs without speculative decoding" in missing
    (unasked,) = speculative_problems(URL, served(settings), None)
    assert "rollout.speculative is not set" in unasked
    config = served(settings)
    config["observability_config"]["per_request_spec_decode_metrics"] = "none"
    (silent,) = speculative_problems(URL, config, settings)
    assert "--per-request-spec-decode-metrics summary" in silent


def test_acceptance_counts_from_a_server_answer_and_an_in_process_completion():
    metrics = {
        "speculative_decoding": {
            "num_spec_steps": 10,
            "num_draft_tokens": 40,
            "num_accepted_draft_tokens": 30,
            "mean_acceptance_length": 4.0,
        }
    }
    stats = SpeculationStats.from_metrics(metrics)
    assert stats == SpeculationStats(10, 40, 30) and stats.acceptance_rate == 0.75
    assert (
        SpeculationStats.from_metrics(None) is None
        and SpeculationStats.from_metrics({"speculative_decoding": None}) is None
    )

    class RequestMetrics:  # vLLM's RequestSpecDecodeMetrics: entry j counts the steps that accepted j drafts
        histogram = [2, 1, 0, 3]
        num_draft_tokens = 18

    assert SpeculationStats.from_request_metrics(RequestMetrics()) == SpeculationStats(6, 18, 1 + 9)
    assert stats + SpeculationStats(1, 4, 1) == SpeculationStats(11, 44, 31)
