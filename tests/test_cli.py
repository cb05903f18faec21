"""The `tslightning` command line: `verify` reports the App. G figures and fails when exactness fails; settings are
documented in --help; configs resolve before or after the command and by shipped name; user errors are one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tslightning import cli
from tslightning.commands import verification
from tslightning.core.replay_batches import WorkloadShape

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
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


def _settings_classes(cls, seen=None) -> set[type]:
    """The settings dataclass ``cls`` and every dataclass its fields hold, at any depth."""
    import dataclasses
    import typing

    seen = set() if seen is None else seen
    seen.add(cls)
    for field in dataclasses.fields(cls):
        hints = typing.get_type_hints(cls)[field.name]
        for candidate in (hints, *typing.get_args(hints)):
            if dataclasses.is_dataclass(candidate) and candidate not in seen:
                _settings_classes(candidate, seen)
    return seen


def test_every_fit_setting_has_a_docstring_that_help_shows(capsys):
    import dataclasses
    import inspect

    import docstring_parser

    from tslightning.loop.fit import fit

    classes = set()
    for parameter in inspect.signature(fit).parameters.values():
        if dataclasses.is_dataclass(parameter.default):
            classes |= _settings_classes(type(parameter.default))
    assert len(classes) >= 9  # model, tiny, lora, rollout, simulated tool, warm start, optimizer, checkpoint, learner
    undocumented = [
        f"{cls.__name__}.{p.arg_name}"
        for cls in classes
        for p in docstring_parser.parse_from_object(cls).params
        if not p.description
    ]
    documented = {p.arg_name for cls in classes for p in docstring_parser.parse_from_object(cls).params}
    missing = [
        f"{cls.__name__}.{f.name}" for cls in classes for f in dataclasses.fields(cls) if f.name not in documented
    ]
    assert undocumented == [] and missing == []
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    for doc in (
        "P, prompts (GRPO groups) per logical batch",
        "Most requests one ``hf`` replica decodes together",
        "AdamW's β1, β2",
        "Width of the residual stream",
        "Replace the earlier run in ``out_dir``",
    ):
        assert doc in help_text, doc
    with pytest.raises(SystemExit):
        cli.main(["fit", "--model.lora.help"])  # an optional settings group documents itself on request
    assert "Rank of each adapter" in capsys.readouterr().out


def test_top_level_config_before_the_command_is_the_commands_config(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["--config", "configs/quickstart.yaml", "fit", "--updates", "5", "--print_config"])
    out = capsys.readouterr().out
    assert "updates: 5" in out and "warm_start:\n  steps: 1600" in out  # the config's, then the command line's
    nested = tmp_path / "nested.yaml"  # jsonargparse's own form: settings under the command's name
    nested.write_text("fit:\n  updates: 7\n")
    with pytest.raises(SystemExit):
        cli.main(["--config", str(nested), "fit", "--print_config"])
    assert "updates: 7" in capsys.readouterr().out


def test_a_shipped_config_resolves_by_name_from_anywhere(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here, as after a plain pip install
    for name in ("quickstart", "quickstart.yaml", "configs/quickstart.yaml"):
        with pytest.raises(SystemExit):
            cli.main(["fit", "--config", name, "--print_config"])
        assert "updates: 30" in capsys.readouterr().out, name
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", "quikstart"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "--config quikstart is neither a file nor a shipped config" in err and "quickstart_opd" in err
    assert set(cli.shipped_configs()) == {p.stem for p in CONFIGS}


def test_print_config_with_a_trainer_callback_prints_and_fit_refuses_it(capsys, tmp_path):
    timer = '[{class_path: lightning.pytorch.callbacks.Timer, init_args: {duration: "00:01:00:00"}}]'
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", "quickstart", "--callbacks", timer, "--print_config"])
    assert exit_info.value.code == 0 and "interval: step" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", "quickstart", "--callbacks", timer, "--out_dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and "Timer is a Trainer callback" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_user_errors_are_one_line_and_debug_raises_them(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", "quickstart", "--rollout.engine", "tgi"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and 'Parser key "rollout.engine"' in err
    with pytest.raises(SystemExit):  # a settings class refusing a value at instantiation
        cli.main(["fit", "--config", "quickstart", "--model.tiny.hidden_size", "100"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "TinyModelConfig.hidden_size" in err
    from jsonargparse import ArgumentError

    with pytest.raises(ArgumentError, match="rollout.engine"):
        cli.main(["fit", "--config", "quickstart", "--rollout.engine", "tgi", "--debug"])
    with pytest.raises(ValueError, match="TinyModelConfig.hidden_size"):
        cli.main(["--debug", "fit", "--config", "quickstart", "--model.tiny.hidden_size", "100"])


def test_overwrite_may_be_given_bare():
    assert cli._expand_bare_flags(["fit", "--overwrite", "--updates", "2"]) == [
        "fit",
        "--overwrite",
        "true",
        "--updates",
        "2",
    ]
    assert cli._expand_bare_flags(["fit", "--overwrite", "false"]) == ["fit", "--overwrite", "false"]


def _subcommand_helps(cli, prefix: str = "") -> dict[str, str | None]:
    action = cli._subcommands_action
    helps = {prefix + choice.dest: choice.help for choice in action._choices_actions}
    for name, sub in action.choices.items():
        if getattr(sub, "_subcommands_action", None) is not None:
            helps |= _subcommand_helps(sub, f"{prefix}{name} ")
    return helps


def test_every_command_says_what_it_does_in_one_whole_sentence():
    """The one line `tslightning --help` shows per command (its docstring's first line) is a whole sentence: a
    docstring whose first sentence wraps would be cut mid-sentence there."""
    from tslightning.cli import parser

    helps = _subcommand_helps(parser())
    assert {"fit", "plan", "bench", "tasks", "tasks validate"} <= set(helps)
    cut = {name: text for name, text in helps.items() if not text or not text.rstrip().endswith((".", ")"))}
    assert not cut, f"these commands' help is missing or cut: {cut}"
