"""task.toml as Harbor reads it: the current schema's keys honoured, unknown keys warned about, ${VAR} templates."""

from __future__ import annotations

import tomllib

import pytest

from tslightning.tasks.harbor.task_config import Artifact, HealthcheckSettings, read_task_config, resolve_template

TB21_TASK_TOML = """
schema_version = "1.1"
artifacts = []

[task]
name = "terminal-bench/adaptive-rejection-sampler"
description = "Implement an adaptive rejection sampler in R."
keywords = ["applied-statistics", "simulation"]
[[task.authors]]
name = "jvpoulos"
email = "poulos@example.org"

[metadata]
difficulty = "medium"
category = "scientific-computing"
expert_time_estimate_min = 180.0

[verifier]
timeout_sec = 900.0

[agent]
timeout_sec = 900.0

[environment]
build_timeout_sec = 600.0
docker_image = "alexgshaw/adaptive-rejection-sampler:20251031"
cpus = 1
memory_mb = 2048
storage_mb = 10240
"""


def _read(text: str, host_env=None):
    problems: list[str] = []
    config = read_task_config(tomllib.loads(text), problems, host_env or {})
    return config, problems


def test_a_terminal_bench_2_1_task_toml_reads_without_a_warning():
    config, problems = _read(TB21_TASK_TOML)
    assert problems == [] and config.warnings == ()
    assert config.schema_version == "1.1" and config.artifacts == ()
    assert config.package["name"] == "terminal-bench/adaptive-rejection-sampler"
    assert config.environment.docker_image == "alexgshaw/adaptive-rejection-sampler:20251031"
    assert config.verifier.timeout_sec == 900.0 and config.agent.timeout_sec == 900.0
    assert config.environment.network == "public"  # Harbor's default: allow_internet = true


def test_current_harbor_keys_are_honoured():
    text = """
schema_version = "1.4"
artifacts = ["/app/out.txt", { source = "/var/log/app", destination = "logs", exclude = ["*.tmp"] }]
[environment]
workdir = "/srv/work"
allow_internet = false
env = { TOKEN = "${SECRET}", MODE = "${MODE:-fast}", PLAIN = "x" }
healthcheck = { command = "test -f /srv/ready", interval_sec = 0.5, retries = 2 }
[verifier]
env = { LEVEL = "${LEVEL:-3}" }
user = "root"
"""
    config, problems = _read(text, {"SECRET": "s3"})
    assert problems == [] and config.warnings == ()
    environment = config.environment
    assert environment.workdir == "/srv/work" and environment.network == "no-network"
    assert environment.env == {"TOKEN": "s3", "MODE": "fast", "PLAIN": "x"}
    assert environment.healthcheck == HealthcheckSettings("test -f /srv/ready", interval_sec=0.5, retries=2)
    assert config.verifier.env == {"LEVEL": "3"} and config.verifier.user == "root"
    assert config.artifacts == (Artifact("/app/out.txt"), Artifact("/var/log/app", "logs", ("*.tmp",)))


def test_network_mode_wins_and_hosts_imply_an_allowlist():
    config, _ = _read('[environment]\nallow_internet = true\nnetwork_mode = "no-network"\n')
    assert config.environment.network == "no-network"
    config, _ = _read('[environment]\nallowed_hosts = ["pypi.org"]\n')
    assert config.environment.network == "allowlist" and config.environment.allowed_hosts == ("pypi.org",)


def test_an_unset_variable_without_default_is_a_problem_naming_it():
    _, problems = _read('[environment]\nenv = { KEY = "${OPENAI_API_KEY}" }\n')
    assert problems == [
        "task.toml: [environment] env.KEY needs ${OPENAI_API_KEY} from the trainer's environment, which is not set; "
        "export it, or give a default (${OPENAI_API_KEY:-value})"
    ]


def test_resolve_template():
    assert resolve_template("a-${X}-${Y:-d}-$Z", {"X": "1"}) == "a-1-d-$Z"
    with pytest.raises(KeyError):
        resolve_template("${NOPE}", {})


def test_steps_and_strategy():
    text = """
multi_step_reward_strategy = "final"
[[steps]]
name = "scaffold"
min_reward = 1.0
[steps.agent]
timeout_sec = 60.0
[[steps]]
name = "implement"
min_reward = { correctness = 0.5 }
artifacts = ["/app/report.txt"]
[steps.verifier]
timeout_sec = 30.0
"""
    config, problems = _read(text)
    assert problems == [] and config.multi_step_reward_strategy == "final"
    first, second = config.steps
    assert (first.name, first.min_reward, first.agent.timeout_sec) == ("scaffold", 1.0, 60.0)
    assert second.min_reward == {"correctness": 0.5} and second.verifier.timeout_sec == 30.0
    assert second.artifacts == (Artifact("/app/report.txt"),)


def test_bad_values_name_the_key():
    text = """
multi_step_reward_strategy = "best"
artifacts = [3]
[environment]
workdir = "relative"
network_mode = "open"
[[steps]]
name = "../up"
[[steps]]
name = "ok"
min_reward = "high"
bogus = 1
"""
    config, problems = _read(text)
    assert "task.toml: multi_step_reward_strategy must be 'mean' or 'final'; got 'best'" in problems
    assert "task.toml: artifacts must be paths or tables with a 'source' string; got 3" in problems
    assert "task.toml: [environment] workdir must be an absolute path; got 'relative'" in problems
    assert any(p.startswith("task.toml: [environment] network_mode must be one of") for p in problems)
    assert any(p.startswith("task.toml: [steps[0]] name must be a unique directory name") for p in problems)
    assert "task.toml: [steps[1]] min_reward must be a number or a table of named rewards; got 'high'" in problems
    assert config.warnings == ("task.toml: unknown key [steps[1]] bogus ignored (as Harbor does)",)
