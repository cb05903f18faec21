"""``fit``'s harness start-up: one gateway per rank on loopback at a port the OS picks, segments for every objective,
the harness program per ``harness.name``, and the warm start's layout."""

from __future__ import annotations

import sys

import requests

from tslightning.loop.harness import start_harness, warm_start_format
from tslightning.loop.settings import RolloutSettings
from tslightning.rollout.harness.settings import HarnessSettings


class _Engine:
    policy_version = 0


def test_each_rank_starts_its_own_gateway_on_loopback_and_the_harness_program(tokenizer, tmp_path):
    harness = HarnessSettings(name="command", command=[sys.executable, "harness.py"], timeout_s=60)
    agents = [
        start_harness(harness, _Engine(), tokenizer, RolloutSettings(max_turns=5), None, 1, tmp_path) for _ in range(2)
    ]
    try:
        urls = [agent.gateway.url for agent in agents]
        assert all(url.startswith("http://127.0.0.1:") for url in urls) and urls[0] != urls[1]
        assert requests.get(f"{urls[0]}/v1/models", timeout=10).json()["data"][0]["id"] == "tslightning-policy"
        assert all(agent.gateway.allow_segments for agent in agents)  # GRPO sources take a sequence per segment
        assert agents[0].limits.max_turns == 5 and agents[0].log_dir == tmp_path / "attempts"
        assert list(agents[0].program.command) == [sys.executable, "harness.py"] and agents[0].program.timeout_s == 60
    finally:
        for agent in agents:
            agent.close()
    assert warm_start_format(harness) is None and warm_start_format(HarnessSettings()) is None


def test_preflight_names_a_harness_that_cannot_run_before_anything_is_written():
    from tslightning.distributed.learner_strategy import LearnerSettings
    from tslightning.loop.preflight import harness_problems
    from tslightning.loop.warm_start import WarmStartSettings

    run = ("grpo", "thundersync", "recompute", RolloutSettings(), WarmStartSettings())
    no_mini = HarnessSettings(name="mini_swe_agent", python=sys.executable)  # this environment has no mini-swe-agent
    (problem,) = harness_problems(no_mini, *run, LearnerSettings())
    assert problem.startswith(f"harness.python {sys.executable} cannot run mini-swe-agent")
    fixed_port = HarnessSettings(name="command", command=[sys.executable], port=8765)
    (problem,) = harness_problems(fixed_port, *run, LearnerSettings(devices=2))
    assert problem.startswith("harness.port 8765: each of the node's 2 learner ranks runs its own gateway")
