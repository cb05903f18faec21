"""`tslightning verify`: the command line reports the App. G figures and fails when exactness fails."""

from __future__ import annotations

import json

import pytest
import torch

from tslightning import cli
from tslightning.commands import verification
from tslightning.core.replay_batches import WorkloadShape

SMALL = WorkloadShape(num_groups=2, group_size=3, max_turns=2)


@pytest.fixture(autouse=True)
def small_workload(monkeypatch):
    original = verification.verify
    monkeypatch.setattr(cli, "run_verification", lambda **kw: original(shape=SMALL, **kw))


@pytest.mark.parametrize("objective", ["grpo", "opd"])
def test_verify_json_float64(capsys, objective):
    cli.main(["verify", "--objective", objective, "--updates", "2", "--seed", "3", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["objective"] == objective and report["dtype"] == "float64"
    assert report["first_direction_rel_error"] <= 1e-10
    assert 1 - report["first_direction_cosine"] <= 1e-12
    assert len(report["parameter_gap"]) == len(report["bf16_reference_gap"]) == 2
    # App. G: the schedules' gap sits orders of magnitude below the bf16 precision-of-training gap.
    assert max(report["parameter_gap"]) < 1e-6 * min(report["bf16_reference_gap"])


def test_verify_text_float32(capsys):
    cli.main(["verify", "--dtype", "float32", "--updates", "1"])
    out = capsys.readouterr().out
    assert "PASS" in out and "float32" in out and "tolerance 1e-05" in out


def test_verify_exits_nonzero_when_streaming_is_not_exact(monkeypatch, capsys):
    """Break the streamed direction on purpose: verify must notice and exit 1."""
    original = verification._Replay.update

    def corrupted(self, batch):
        original(self, batch)
        if self.module.schedule == "thundersync":
            self.directions[-1] = self.directions[-1] * (1 + 1e-8)

    monkeypatch.setattr(verification._Replay, "update", corrupted)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["verify", "--updates", "1"])
    assert exit_info.value.code == 1
    assert "FAIL" in capsys.readouterr().out


def test_verify_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["verify", "--objective", "ppo"])
    assert "objective" in capsys.readouterr().err
    with pytest.raises(ValueError, match="updates"):
        verification.verify(updates=0)


def test_bare_json_flag_expansion():
    assert cli._expand_bare_flags(["verify", "--json"]) == ["verify", "--json", "true"]
    assert cli._expand_bare_flags(["verify", "--json", "--seed", "1"]) == ["verify", "--json", "true", "--seed", "1"]
    assert cli._expand_bare_flags(["verify", "--json", "false"]) == ["verify", "--json", "false"]
    assert torch.get_default_dtype() == torch.float32  # verify never leaks a global dtype change
