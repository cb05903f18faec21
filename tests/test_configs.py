"""Every shipped config parses against `tslightning fit`, opens with its launch command, and bad values name the key."""

from __future__ import annotations

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
