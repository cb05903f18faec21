"""Shared fixtures: the tiny real transformer (built offline) in the dtypes the exactness tests need."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

from tslightning.learner.precision import compute_norms_in_float64
from tslightning.models.tiny_model import TinyModelConfig, build_tiny_model, build_tokenizer

# The shared check modules assert for the tests that import them: rewrite them too, so a failure shows its values.
pytest.register_assert_rewrite(
    "engine_checks", "harness", "reference", "recorded_replay", "multirank_cases", "resume_cases", "replica_fault"
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

SLOW = (
    # vLLM engines and servers, Ray, server-backed teachers: each starts processes and loads vLLM (20-120 s a test).
    "tests/rollout/test_vllm_",
    "tests/rollout/test_replica_launcher.py",
    "tests/rollout/test_replica_server.py",
    "tests/rollout/test_teacher_server.py",
    "tests/rollout/test_end_to_end.py",
    "tests/loop/test_rollout_servers.py",
    "tests/loop/test_startup.py::test_the_ray_launcher",
    # Learner ranks launched as subprocesses (gloo), kill/resume across processes.
    "tests/distributed/test_multirank.py",
    "tests/distributed/test_sharded_resume.py",
    "tests/distributed/test_kill_resume.py",
    "tests/distributed/test_statistics_shards.py",
    "tests/distributed/test_collectives.py",
    "tests/distributed/test_learner_strategy.py::test_fit_takes_checkpoints",
    # Whole `fit` runs (warm start, rollout replica, several updates) and the examples.
    "tests/loop/test_fit.py::test_quickstart_fit_runs_end_to_end",
    "tests/loop/test_fit.py::test_async",
    "tests/loop/test_fit.py::test_fully_async",
    "tests/loop/test_fit.py::test_sync_and_thundersync",
    "tests/loop/test_fit.py::test_the_saved_config",
    "tests/loop/test_fit.py::test_environment_prefetch",
    "tests/loop/test_resume.py::test_kill_resume",
    "tests/loop/test_batch_replay.py::test_a_replay_on",
    "tests/test_examples.py",
    "tests/commands/test_bench.py::test_bench_runs",
    "tests/commands/test_evaluation.py::test_trained_checkpoint",
    "tests/commands/test_evaluation.py::test_a_fit_run_is_compared",
    # Float64 boundary-adjoint exactness over many shapes, seeds and estimators: 265 s for the first alone under a
    # load average of 9 (2026-12-06); the recompute-path exactness (test_streaming_exactness.py) stays fast.
    "tests/learner/test_boundary_adjoint.py::test_grpo_shared_prefix_equals_recompute_float64",
    "tests/learner/test_boundary_adjoint.py::test_opd_turn_boundaries_equal_recompute_float64",
    "tests/learner/test_streaming_boundary_exactness.py::test_grpo_boundary_module_equals_sync_float64",
    "tests/learner/test_streaming_boundary_exactness.py::test_opd_boundary_module_equals_sync_float64",
    "tests/callbacks/test_weight_publisher.py::test_hf_engine_serves_the_updated_policy",  # 17 s: a replica process
    # Several processes or a server each: the GPU check's dry run, the gateway on the server and mini-swe-agent,
    # compose helpers in a fit, learner ranks measured or failed on purpose, replica processes, CLI subprocesses.
    "tests/test_check_gpu_script.py",
    "tests/rollout/gateway/test_gateway_on_server.py",
    "tests/rollout/gateway/test_mini_swe_agent.py",
    "tests/rollout/gateway/test_harness_agent.py::test_a_harness_over_its_time",
    "tests/tasks/test_helper_services.py::test_the_cookbook_mcp_task",
    "tests/tasks/test_helper_services.py::test_fit_runs_two_updates",
    "tests/distributed/test_unit_memory.py",
    "tests/distributed/test_failure_watch.py::test_an_oom_mid_pass",
    "tests/loop/test_preflight.py::test_debug_shows_the_traceback",
    "tests/sandbox/test_hostile_agent.py::test_a_non_editable_install",
    "tests/tasks/test_task_validation.py::test_every_shipped_task_validates",
    "tests/models/test_tiny_model.py::test_tokenizer_is_deterministic_across_processes",
    "tests/rollout/test_hf_engine.py",
    # Real sandboxes held for seconds (limits, live environments, verifier integrity, compose helpers), the docs build
    # and the plotting commands: run them when working on those parts.
    "tests/tasks/test_helper_services.py",
    "tests/tasks/test_reward_integrity.py",
    "tests/sandbox/test_live_environment.py",
    "tests/sandbox/test_init_process.py",
    "tests/test_docs.py",
    "tests/test_predict_cli.py",
    "tests/measure/test_speedup_plots.py",
    # Builds: a wheel, Debian roots (mmdebstrap), offline toolchains.
    "tests/test_configs.py::test_a_plain_install",
    "tests/tasks/test_image_lite.py",
    "tests/tasks/test_image_user.py",
    "tests/tasks/test_build_network.py",
    "tests/tasks/test_offline_toolchain.py",
)
"""Tests of the slow tier (node-id prefixes): CI runs every test (``pytest -m "slow or not slow"``, the README's
command); plain ``pytest`` skips these. Chosen by measured duration: a test of several seconds that starts servers,
Ray, vLLM, learner ranks, a whole ``fit`` or a build. Mark a new test of that kind here (or ``@pytest.mark.slow``)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def _base_policy(tokenizer):
    return build_tiny_model(TinyModelConfig(seed=0), tokenizer)


@pytest.fixture(scope="session")
def _base_teacher(tokenizer):
    return build_tiny_model(TinyModelConfig(seed=1), tokenizer)


def _in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    model = copy.deepcopy(model).to(dtype)
    if dtype == torch.float64:
        compute_norms_in_float64(model)
    return model


@pytest.fixture
def make_policy(_base_policy):
    """``make_policy(dtype)``: a fresh copy of θ_0 in ``dtype`` (float64 with float64 norms)."""
    return lambda dtype=torch.float64: _in_dtype(_base_policy, dtype)


@pytest.fixture(scope="session")
def teacher64(_base_teacher):
    return _in_dtype(_base_teacher, torch.float64)


@pytest.fixture(scope="session")
def vocab_size(_base_policy):
    return _base_policy.config.vocab_size


@pytest.fixture(autouse=True)
def _process_placement_is_given_back():
    """Every test leaves the session's cores and torch thread count as it found them: an in-process engine started
    later sizes its CPU kernels from them (vLLM's CPU attention aborts when they disagree). A test whose code keeps
    them changed is reported (a warning naming the test) and the placement restored for the tests after it."""
    before = os.sched_getaffinity(0), torch.get_num_threads()
    yield
    after = os.sched_getaffinity(0), torch.get_num_threads()
    if after != before:
        os.sched_setaffinity(0, before[0])
        torch.set_num_threads(before[1])
        warnings.warn(f"the test left cores/threads {after}, not {before}: restored", stacklevel=1)


# Task fixtures (tests/fixtures/**) hold the tasks' own verifier files (test_outputs.py etc.), not tests of this
# project: they run inside a task's sandbox, never in this session.
collect_ignore_glob = ["fixtures/*"]
