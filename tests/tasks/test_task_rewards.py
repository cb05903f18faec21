"""Rewards (App. E.1): binary and SETA partial, and the verifier's reward.txt / reward.json."""

from __future__ import annotations

import json

import pytest

from tslightning.tasks.rewards import (
    EVERY_NAMED_REWARD,
    RewardFileError,
    binary_reward,
    max_reward,
    parse_reward_json,
    parse_reward_txt,
    read_reward_files,
    reward_for,
    seta_reward,
)


@pytest.mark.parametrize(
    ("fraction", "binary", "seta"),
    [(0.0, 0.0, 0.0), (0.25, 0.0, 0.25), (2 / 3, 0.0, 2 / 3), (0.999, 0.0, 0.999), (1.0, 1.0, 1.5)],
)
def test_binary_and_seta_rewards(fraction, binary, seta):
    assert binary_reward(fraction) == binary == reward_for(fraction, "binary")
    assert seta_reward(fraction) == pytest.approx(seta) == reward_for(fraction, "seta")


def test_seta_bonus_only_on_a_full_pass():
    assert seta_reward(3 / 3) - seta_reward(2 / 3) == pytest.approx(1 / 3 + 0.5)
    assert max_reward("seta") == 1.5 and max_reward("binary") == 1.0


@pytest.mark.parametrize("bad", [-0.1, 1.01, float("nan")])
def test_reward_functions_reject_fractions_outside_unit_interval(bad):
    with pytest.raises(ValueError, match="passed_fraction"):
        seta_reward(bad)
    with pytest.raises(ValueError, match="passed_fraction"):
        binary_reward(bad)


def test_unknown_scheme_is_named():
    with pytest.raises(ValueError, match="'partial'"):
        reward_for(0.5, "partial")


def test_reward_json_counts():
    reading = parse_reward_json(json.dumps({"tests_passed": 3, "tests_total": 4, "reward": 0.75}))
    assert reading.passed_fraction == 0.75 and (reading.tests_passed, reading.tests_total) == (3, 4)
    assert reading.reported_reward == 0.75 and reading.source == "reward.json"
    assert reading.reward("seta") == 0.75 and reading.reward("binary") == 0.0
    full = parse_reward_json('{"tests_passed": 4, "tests_total": 4}')
    assert full.reward("seta") == 1.5 and full.reward("binary") == 1.0
    assert full.describe() == "4/4 tests passed (reward.json)"


def test_reward_json_harbor_reward_key_is_the_fraction():
    reading = parse_reward_json('{"reward": 1}')
    assert reading.passed_fraction == 1.0 and reading.reward("seta") == 1.5


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ("{}", "needs 'tests_passed' and 'tests_total', or 'reward'"),
        ('{"tests_passed": 2}', "no 'tests_total'"),
        ('{"tests_passed": 2.0, "tests_total": 4}', "'tests_passed' must be an integer"),
        ('{"tests_passed": true, "tests_total": 4}', "'tests_passed' must be an integer"),
        ('{"tests_passed": 5, "tests_total": 4}', r"'tests_passed' must be in \[0, tests_total=4\]"),
        ('{"tests_passed": 0, "tests_total": 0}', "'tests_total' must be at least 1"),
        ('{"reward": "high"}', "'reward' must be a finite number"),
        ('{"reward": 1.5}', r"must be a pass fraction in \[0, 1\]"),
        ('{"tests_passed": 1, "tests_total": 2, "reward": null}', "'reward' must be a finite number"),
    ],
)
def test_malformed_reward_json_is_a_clear_error(text, match):
    with pytest.raises(RewardFileError, match=match):
        parse_reward_json(text)


def test_reward_txt():
    assert parse_reward_txt("1\n") == 1.0
    assert parse_reward_txt(" 0.333333 ") == 0.333333
    for text, match in [("", "empty"), ("passed", "one number"), ("1.5", r"\[0, 1\]"), ("-1", r"\[0, 1\]")]:
        with pytest.raises(RewardFileError, match=match):
            parse_reward_txt(text)


def test_read_reward_files_prefers_json(tmp_path):
    (tmp_path / "reward.txt").write_text("0.500000\n")  # both files must agree (see test_reward_integrity)
    (tmp_path / "reward.json").write_text('{"tests_passed": 1, "tests_total": 2}')
    reading = read_reward_files(tmp_path)
    assert reading.passed_fraction == 0.5 and reading.source == "reward.json"


def test_read_reward_files_falls_back_to_txt(tmp_path):
    (tmp_path / "reward.txt").write_text("1")
    reading = read_reward_files(tmp_path)
    assert reading.passed_fraction == 1.0 and reading.source == "reward.txt" and reading.error is None


def test_missing_and_malformed_files_score_zero_with_a_reason(tmp_path):
    missing = read_reward_files(tmp_path)
    assert missing.passed_fraction is None and missing.reward("seta") == 0.0
    assert "neither reward.json nor reward.txt" in missing.error
    (tmp_path / "reward.txt").write_text("all good")
    malformed = read_reward_files(tmp_path)
    assert malformed.reward("seta") == 0.0 and malformed.source == "reward.txt"
    assert "reward.txt must hold one number" in malformed.error == malformed.describe()
    (tmp_path / "reward.json").write_bytes(b"\xff\xfe")
    undecodable = read_reward_files(tmp_path)
    assert undecodable.reward("binary") == 0.0 and "cannot read reward.json" in undecodable.error


def test_symlinked_or_huge_reward_files_are_refused(tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("1")
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "reward.txt").symlink_to(secret)
    reading = read_reward_files(logs)
    assert reading.reward("seta") == 0.0 and reading.error == "reward.txt is a symbolic link; refused"
    (logs / "reward.txt").unlink()
    (logs / "reward.txt").write_text("1" + " " * 70_000)
    assert "larger than 65536 bytes" in read_reward_files(logs).error


def test_named_rewards_the_chosen_key_is_the_fraction():
    text = json.dumps({"correctness": 1.0, "performance": 0.25, "note": "fast"})
    reading = parse_reward_json(text, key="performance")
    assert reading.passed_fraction == 0.25 and reading.key == "performance"
    assert reading.named == {"correctness": 1.0, "performance": 0.25}
    assert reading.describe() == "performance 0.25 (reward.json)"
    assert parse_reward_json(text, key="correctness").reward("seta") == 1.5
    with pytest.raises(RewardFileError, match=r"named rewards \['correctness', 'performance'\] but no 'reward'"):
        parse_reward_json(text)  # the default key, absent: say which keys there are and how to choose
    with pytest.raises(RewardFileError, match="has no reward 'speed'"):
        parse_reward_json(text, key="speed")
    with pytest.raises(RewardFileError, match=r"'score' must be a pass fraction in \[0, 1\]"):
        parse_reward_json('{"score": 7}', key="score")


def test_named_reward_beside_counts_and_reward_txt_agreement(tmp_path):
    (tmp_path / "reward.json").write_text('{"tests_passed": 1, "tests_total": 2, "style": 1.0}')
    (tmp_path / "reward.txt").write_text("0.5\n")  # reward.txt stands for the counts
    assert read_reward_files(tmp_path).passed_fraction == 0.5
    reading = read_reward_files(tmp_path, key="style")
    assert reading.passed_fraction == 1.0 and reading.error is None and reading.tests_total == 2
    # A named-only reward.json forged beside an honest reward.txt disagrees with it.
    (tmp_path / "reward.json").write_text('{"correctness": 1.0}')
    (tmp_path / "reward.txt").write_text("0\n")
    refused = read_reward_files(tmp_path, key="correctness")
    assert refused.passed_fraction is None and "disagree" in refused.error
    (tmp_path / "reward.txt").unlink()  # Harbor's named-rewards verifiers write reward.json alone
    assert read_reward_files(tmp_path, key="correctness").passed_fraction == 1.0


def test_every_named_reward_must_be_full_when_no_key_is_chosen():
    reading = parse_reward_json('{"accuracy": 1, "latency": 0.75, "note": "ok"}', key=EVERY_NAMED_REWARD)
    assert reading.passed_fraction == 0.75 and reading.key == EVERY_NAMED_REWARD
    assert reading.describe() == "every named reward (accuracy 1, latency 0.75): pass fraction 0.75 (reward.json)"
    assert parse_reward_json('{"accuracy": 1, "latency": 1}', key=EVERY_NAMED_REWARD).reward("seta") == 1.5
    # Counts, else a `reward`, still win over the named numbers beside them.
    counted = parse_reward_json('{"tests_passed": 1, "tests_total": 4, "style": 1}', key=EVERY_NAMED_REWARD)
    assert counted.passed_fraction == 0.25 and counted.key == "reward"
    assert parse_reward_json('{"reward": 0.5, "style": 1}', key=EVERY_NAMED_REWARD).passed_fraction == 0.5
    with pytest.raises(RewardFileError, match=r"'latency' must be a pass fraction in \[0, 1\]"):
        parse_reward_json('{"accuracy": 1, "latency": 3}', key=EVERY_NAMED_REWARD)
