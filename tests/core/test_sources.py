"""Validation of sources (paper §3.2-3.4): every bad field raises SourceError naming that field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tslightning.core.sources import (
    BatchClosed,
    GroupClosed,
    PolicyVersionError,
    SourceError,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)


def ids(*values: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def mask(*bits: int) -> torch.Tensor:
    return torch.tensor([bool(b) for b in bits], dtype=torch.bool)


def trajectory(**overrides) -> TrajectorySource:
    fields = dict(
        group_id="g0",
        trajectory_index=1,
        token_ids=ids(5, 6, 7, 8, 9, 10),
        scored_mask=mask(0, 0, 1, 1, 0, 1),
        reward=0.5,
        policy_version=3,
        prompt_length=2,
    )
    fields.update(overrides)
    return TrajectorySource(**fields)


def turn(**overrides) -> TurnSource:
    fields = dict(
        group_id="g0",
        trajectory_index=0,
        turn_index=2,
        token_ids=ids(5, 6, 7, 8, 9),
        scored_mask=mask(0, 1, 1, 0, 1),
        teacher_logprobs=torch.tensor([-0.1, -2.0, 0.0]),
        policy_version=0,
    )
    fields.update(overrides)
    return TurnSource(**fields)


def raises_naming(field: str, build, **overrides) -> SourceError:
    with pytest.raises(SourceError) as info:
        build(**overrides)
    assert field in str(info.value), f"{field!r} not named in: {info.value}"
    return info.value


# ----------------------------------------------------------------------------- valid records
def test_valid_trajectory_constructs():
    t = trajectory()
    assert t.num_scored == 3
    assert t.reward == 0.5 and t.prompt_length == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.reward = 1.0  # type: ignore[misc]


def test_valid_turn_constructs():
    t = turn()
    assert t.num_scored == 3
    assert t.teacher_logprobs.numel() == 3


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_int32_and_int64_token_ids_accepted(dtype):
    assert trajectory(token_ids=ids(1, 2, 3, 4, 5, 6, dtype=dtype)).num_scored == 3
    assert turn(token_ids=ids(1, 2, 3, 4, 5, dtype=dtype)).num_scored == 3


def test_minimal_trajectory_and_turn():
    t = trajectory(token_ids=ids(0, 0), scored_mask=mask(0, 1), prompt_length=1, reward=0)
    assert t.num_scored == 1
    u = turn(token_ids=ids(0, 0), scored_mask=mask(0, 1), teacher_logprobs=torch.tensor([-0.0], dtype=torch.float64))
    assert u.num_scored == 1


@pytest.mark.parametrize("reward", [0, -3, 1.5, -1e300, 7])
def test_finite_int_and_float_rewards_accepted(reward):
    assert trajectory(reward=reward).reward == reward


def test_policy_version_zero_and_turn_index_zero_accepted():
    assert trajectory(policy_version=0).policy_version == 0
    assert turn(turn_index=0, trajectory_index=0).turn_index == 0


def test_teacher_logprobs_float_dtypes_accepted():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        turn(teacher_logprobs=torch.tensor([-0.1, -2.0, 0.0], dtype=dtype))


def test_policy_version_error_is_a_source_error():
    assert issubclass(PolicyVersionError, SourceError)
    assert issubclass(SourceError, ValueError)


def test_completion_events_are_plain_frozen_records():
    assert TrajectoryClosed("g", 1, 3).num_turn_sources == 3
    assert GroupClosed("g").group_id == "g"
    assert BatchClosed(4).policy_version == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        GroupClosed("g").group_id = "h"  # type: ignore[misc]


# ----------------------------------------------------------------------------- shared token / mask checks
BUILDERS = {"trajectory": trajectory, "turn": turn}


@pytest.fixture(params=["trajectory", "turn"])
def build(request):
    return BUILDERS[request.param]


def test_mask_length_mismatch(build):
    n = 6 if build is trajectory else 5
    err = raises_naming("scored_mask", build, scored_mask=torch.zeros(n + 1, dtype=torch.bool))
    assert "token_ids" in str(err)
    raises_naming("scored_mask", build, scored_mask=mask(0, 1, 1))


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.float32])
def test_non_bool_mask(build, dtype):
    n = 6 if build is trajectory else 5
    bad = torch.zeros(n, dtype=dtype)
    bad[-1] = 1
    raises_naming("scored_mask", build, scored_mask=bad)


def test_mask_not_a_tensor_or_not_1d(build):
    n = 6 if build is trajectory else 5
    raises_naming("scored_mask", build, scored_mask=[False] * (n - 1) + [True])
    raises_naming("scored_mask", build, scored_mask=torch.zeros(1, n, dtype=torch.bool))


def test_empty_scored_mask(build):
    n = 6 if build is trajectory else 5
    raises_naming("scored_mask", build, scored_mask=torch.zeros(n, dtype=torch.bool))


def test_scored_position_zero(build):
    n = 6 if build is trajectory else 5
    bad = torch.zeros(n, dtype=torch.bool)
    bad[0] = True
    bad[-1] = True
    extra = {"teacher_logprobs": torch.tensor([-1.0, -1.0])} if build is turn else {}
    err = raises_naming("scored_mask", build, scored_mask=bad, **extra)
    assert "[0]" in str(err)


def test_negative_token_id(build):
    n = 6 if build is trajectory else 5
    bad = torch.arange(n, dtype=torch.int64)
    bad[3] = -1
    raises_naming("token_ids", build, token_ids=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int16, torch.uint8, torch.bool])
def test_non_int32_int64_token_ids(build, dtype):
    n = 6 if build is trajectory else 5
    raises_naming("token_ids", build, token_ids=torch.ones(n, dtype=dtype))


def test_token_ids_not_a_tensor_or_not_1d(build):
    n = 6 if build is trajectory else 5
    raises_naming("token_ids", build, token_ids=list(range(n)))
    raises_naming("token_ids", build, token_ids=torch.arange(n).reshape(1, n))
    raises_naming("token_ids", build, token_ids=torch.tensor(3))


@pytest.mark.parametrize("length", [0, 1])
def test_too_few_tokens(build, length):
    raises_naming(
        "token_ids", build, token_ids=torch.zeros(length, dtype=torch.int64), scored_mask=torch.ones(length, dtype=bool)
    )


@pytest.mark.parametrize("version", [-1, -100, 1.0, "0", None, True, False])
def test_bad_policy_version(build, version):
    raises_naming("policy_version", build, policy_version=version)


# ----------------------------------------------------------------------------- TrajectorySource-specific
@pytest.mark.parametrize("reward", [float("nan"), float("inf"), float("-inf"), True, False, "1.0", None])
def test_bad_reward(reward):
    raises_naming("reward", trajectory, reward=reward)


@pytest.mark.parametrize("reward", [torch.tensor([1.0, 2.0]), torch.tensor(True), torch.tensor(float("nan"))])
def test_tensor_reward_rejected(reward):
    """Issue 17 turned a 0-d tensor reward from refused to accepted; a tensor that is no one finite number is not."""
    raises_naming("reward", trajectory, reward=reward)


@pytest.mark.parametrize(
    "reward", [np.float32(0.25), np.float64(0.25), np.int64(1), torch.tensor(0.25), torch.tensor([0.25]), 1]
)
def test_numpy_scalar_and_one_element_tensor_rewards_become_python_floats(reward):
    source = trajectory(reward=reward)
    assert type(source.reward) is float and source.reward == float(reward)


def test_numpy_bool_reward_rejected():
    raises_naming("reward", trajectory, reward=np.True_)


def test_huge_int_reward_raises_source_error():
    raises_naming("reward", trajectory, reward=10**400)


@pytest.mark.parametrize("prompt_length", [0, -1, 6, 7, 100, 2.0, None, "2"])
def test_prompt_length_out_of_range(prompt_length):
    raises_naming("prompt_length", trajectory, prompt_length=prompt_length)


def test_prompt_length_largest_valid():
    t = trajectory(scored_mask=mask(0, 0, 0, 0, 0, 1), prompt_length=5)
    assert t.num_scored == 1


@pytest.mark.parametrize("prompt_length", [3, 4, 5])
def test_scored_prompt_tokens(prompt_length):
    # mask scores positions 2, 3, 5: any prompt covering position 2 is rejected
    err = raises_naming("scored_mask", trajectory, prompt_length=prompt_length)
    assert "prompt" in str(err)


@pytest.mark.parametrize("index", [-1, -5, 1.0, "1", None])
def test_bad_trajectory_index(index):
    raises_naming("trajectory_index", trajectory, trajectory_index=index)


# ----------------------------------------------------------------------------- TurnSource-specific
@pytest.mark.parametrize("n", [0, 2, 4])
def test_teacher_logprobs_wrong_length(n):
    err = raises_naming("teacher_logprobs", turn, teacher_logprobs=-torch.ones(n))
    assert str(n) in str(err)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_teacher_logprobs_non_finite(bad):
    raises_naming("teacher_logprobs", turn, teacher_logprobs=torch.tensor([-0.1, bad, -1.0]))


@pytest.mark.parametrize("value", [1e-8, 0.5, 3.0])
def test_teacher_logprobs_positive(value):
    raises_naming("teacher_logprobs", turn, teacher_logprobs=torch.tensor([-0.1, value, -1.0]))


def test_teacher_logprobs_wrong_shape_or_type():
    raises_naming("teacher_logprobs", turn, teacher_logprobs=torch.tensor([[-0.1, -0.2, -0.3]]))
    raises_naming("teacher_logprobs", turn, teacher_logprobs=-torch.ones(3, 1))
    raises_naming("teacher_logprobs", turn, teacher_logprobs=torch.tensor(-0.1))
    raises_naming("teacher_logprobs", turn, teacher_logprobs=torch.tensor([-1, -2, -3]))  # integer
    raises_naming("teacher_logprobs", turn, teacher_logprobs=[-0.1, -0.2, -0.3])


@pytest.mark.parametrize("index", [-1, -7, 0.0, "0", None])
def test_bad_turn_index(index):
    raises_naming("turn_index", turn, turn_index=index)


@pytest.mark.parametrize("index", [-1, 2.0, None])
def test_bad_turn_trajectory_index(index):
    raises_naming("trajectory_index", turn, trajectory_index=index)


# ----------------------------------------------------------------------------- fuzzing
def _expected_valid_tokens(n_tokens: int, bits: list[bool]) -> bool:
    return n_tokens >= 2 and len(bits) == n_tokens and any(bits) and not bits[0]


token_dtypes = st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32])
mask_dtypes = st.sampled_from([torch.bool, torch.bool, torch.bool, torch.uint8])


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=-2, max_value=50), max_size=9),
    bits=st.lists(st.booleans(), max_size=9),
    prompt_length=st.integers(min_value=-1, max_value=10),
    reward=st.floats(allow_nan=True, allow_infinity=True),
    token_dtype=token_dtypes,
    mask_dtype=mask_dtypes,
)
def test_fuzz_trajectory_source(tokens, bits, prompt_length, reward, token_dtype, mask_dtype):
    token_ids = torch.tensor(tokens, dtype=token_dtype)
    scored_mask = torch.tensor(bits, dtype=mask_dtype)
    valid = (
        token_dtype in (torch.int32, torch.int64)
        and mask_dtype == torch.bool
        and _expected_valid_tokens(len(tokens), bits)
        and min(tokens) >= 0
        and reward == reward
        and abs(reward) != float("inf")
        and 1 <= prompt_length < len(tokens)
        and not any(bits[:prompt_length])
    )
    try:
        source = TrajectorySource("g", 0, token_ids, scored_mask, reward, 0, prompt_length)
    except SourceError:
        assert not valid
        return
    assert valid
    assert source.num_scored == sum(bits)
    assert 1 <= source.num_scored <= len(tokens) - prompt_length


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=-2, max_value=50), max_size=9),
    bits=st.lists(st.booleans(), max_size=9),
    logprobs=st.lists(st.floats(min_value=-30.0, max_value=0.0), max_size=9),
    positive=st.booleans(),
    token_dtype=token_dtypes,
    mask_dtype=mask_dtypes,
)
def test_fuzz_turn_source(tokens, bits, logprobs, positive, token_dtype, mask_dtype):
    token_ids = torch.tensor(tokens, dtype=token_dtype)
    scored_mask = torch.tensor(bits, dtype=mask_dtype)
    if positive and logprobs:
        logprobs = [*logprobs[:-1], 0.25]
    teacher = torch.tensor(logprobs, dtype=torch.float64)
    valid = (
        token_dtype in (torch.int32, torch.int64)
        and mask_dtype == torch.bool
        and _expected_valid_tokens(len(tokens), bits)
        and min(tokens) >= 0
        and len(logprobs) == sum(bits)
        and all(lp <= 0 for lp in logprobs)
    )
    try:
        source = TurnSource("g", 0, 0, token_ids, scored_mask, teacher, 0)
    except SourceError:
        assert not valid
        return
    assert valid
    assert source.num_scored == sum(bits) == source.teacher_logprobs.numel()
