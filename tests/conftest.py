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
