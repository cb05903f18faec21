"""`tslightning predict`: the analytical model (App. F) from the command line, as text, JSON and PNGs."""

from __future__ import annotations

import json

import pytest

from tslightning import cli


def test_predict_default_text(capsys):
    cli.main(["predict"])
    out = capsys.readouterr().out
    assert "GRPO, B = 256" in out and "a = 40 turns" in out
    assert "predicted speedup 1.839x" in out  # App. F.6: 1.84x for GRPO at 256 trajectories, r = 1
    assert "sync 4.0500" in out


def test_predict_opd_json(capsys):
    cli.main(["predict", "--objective", "opd", "--batch", "256", "--turns", "300", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["objective"] == "opd" and report["turns"] == 300 and report["plots"] == []
    assert round(report["speedup"], 3) == 1.975  # App. F.6: 1.975x at 300 turns
    assert report["speedup"] <= report["bound"] <= 2
    assert report["sync_step"] == pytest.approx(report["speedup"] * report["thundersync_step"])
    assert report["parameters"] == {
        "capacity": 128,
        "group_size": 8,
        "closure_fraction": 0.02,
        "deferred_fraction": 0.45,
        "service_exponent": 0.49,
        "suffix": 0.05,
    }


def test_predict_overrides_parameters(capsys):
    cli.main(["predict", "--batch", "64", "--ratio", "0.5", "--json"])
    default = json.loads(capsys.readouterr().out)
    assert round(default["speedup"], 2) == 1.71  # App. F.6: B = 64, r = 0.5
    cli.main(["predict", "--batch", "64", "--ratio", "0.5", "--capacity", "64", "--suffix", "0.2", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["capacity"] == 64 and report["parameters"]["suffix"] == 0.2
    assert report["learner_load"] == pytest.approx(2.0) and report["speedup"] < default["speedup"]


def test_predict_writes_plots(tmp_path, capsys, monkeypatch):
    from tslightning.measure import speedup_plots

    original = speedup_plots.write_speedup_surfaces
    monkeypatch.setattr(speedup_plots, "write_speedup_surfaces", lambda d, p: original(d, p, resolution=6))
    cli.main(["predict", "--objective", "opd", "--plots", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    for name in ("speedup_ratio_turns.png", "speedup_ratio_batch.png"):
        path = tmp_path / "plots" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"wrote {path}" in out


def test_predict_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["predict", "--batch", "0", "--closure_fraction", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "batch (B)" in err and "closure_fraction (β)" in err
    with pytest.raises(SystemExit):
        cli.main(["predict", "--objective", "ppo"])
    assert "objective" in capsys.readouterr().err


def test_predict_help_lists_the_parameters(capsys):
    with pytest.raises(SystemExit):
        cli.main(["predict", "--help"])
    out = capsys.readouterr().out
    for flag in ("--turns", "--capacity", "--service_exponent", "--plots", "App. F"):
        assert flag in out
