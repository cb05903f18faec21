"""Every shipped config parses against `tslightning fit`, opens with its launch command, and bad values name the key."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser

from tslightning import cli
from tslightning.loop.fit import fit

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def parser() -> ArgumentParser:
    p = ArgumentParser(exit_on_error=False)
    p.add_argument("--config", action="config")
    p.add_function_arguments(fit)
    return p


def test_there_are_configs():
    assert any(c.name == "quickstart.yaml" for c in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_config_parses_and_documents_its_launch_command(config):
    parsed = parser().parse_args(["--config", str(config)])
    assert parsed.objective in ("grpo", "opd") and parsed.updates >= 1
    first_lines = config.read_text().splitlines()[:3]
    assert any("tslightning fit --config configs/" + config.name in line for line in first_lines)


def test_bad_value_names_the_key(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", "configs/quickstart.yaml", "--rollout.engine", "tgi"])
    assert "rollout.engine" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", "configs/quickstart.yaml", "--schedule", "sometimes"])
    assert "schedule" in capsys.readouterr().err


def test_print_config_shows_the_resolved_values(capsys):
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", "configs/quickstart.yaml", "--rollout.prompts_per_update", "2", "--print_config"])
    out = capsys.readouterr().out
    assert "prompts_per_update: 2" in out and "schedule: thundersync" in out


def test_extra_callbacks_take_class_path_and_init_args(tmp_path):
    config = tmp_path / "extra.yaml"
    config.write_text(
        "callbacks:\n  - class_path: tslightning.callbacks.StalenessMonitor\n    init_args:\n      max_policy_lag: 2\n"
    )
    parsed = parser().parse_args(["--config", "configs/quickstart.yaml", "--config", str(config)])
    init = parser().instantiate_classes(parsed)
    (monitor,) = init.callbacks
    assert type(monitor).__name__ == "StalenessMonitor" and monitor.max_policy_lag == 2


def test_a_plain_install_ships_the_configs_and_resolves_them_by_name(tmp_path):
    """`tslightning fit --config quickstart` from a built wheel (not the editable checkout): the wheel carries
    configs/ as package data, byte for byte, and the command finds it by name from any directory."""
    root, source = Path(__file__).parents[1], tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, source / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(root / "src", source / "src", symlinks=True, ignore=skip)  # src/tslightning/configs is a link
    shutil.copytree(root / "configs", source / "configs")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path)]
    subprocess.run([*build, str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("tslightning-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.startswith("tslightning/configs/")]
        assert {Path(n).name: archive.read(n) for n in names} == {c.name: c.read_bytes() for c in CONFIGS}
        archive.extractall(tmp_path / "installed")
    script = (
        "import tslightning.cli as c; print(c.__file__); c.main(['fit', '--config', 'quickstart', '--print_config'])"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "installed")}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(str(tmp_path / "installed")) and "updates: 30" in done.stdout


def test_a_config_or_flag_of_a_moved_key_names_its_new_key_in_one_line(tmp_path, capsys):
    """0.1.0 moved fit's learning-algorithm settings under ``algorithm``: an old config or flag is refused with the
    rename, before anything is written."""
    old = tmp_path / "old.yaml"
    old.write_text("updates: 2\nadvantage: rloo\noptimizer:\n  lr: 0.001\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(old), "--max_grad_norm", "2", "--out_dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert f"advantage → algorithm.advantage (in {old})" in err and f"optimizer → algorithm.optimizer (in {old})" in err
    assert "--max_grad_norm → --algorithm.max_grad_norm" in err
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):
        cli.main(["plan", "--config", str(old)])
    assert "optimizer → algorithm.optimizer" in capsys.readouterr().err
