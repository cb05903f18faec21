"""The resolved config a run saves is plain data that `tslightning fit --config` reads back to the same settings."""

from __future__ import annotations

import enum
import inspect
import json
import warnings

import pytest

from tslightning import cli
from tslightning.callbacks import MFUMonitor, StalenessMonitor
from tslightning.learner.settings import OptimizerSettings
from tslightning.loop.fit import AlgorithmSettings, LoraSettings, ModelSettings, RolloutSettings, fit
from tslightning.loop.run_config import callback_spec, config_yaml, plain, resolved_config, yaml_text


def fit_arguments(**overrides) -> dict:
    """``fit``'s arguments in signature order, as ``fit`` sees them in ``locals()``."""
    defaults = {name: p.default for name, p in inspect.signature(fit).parameters.items()}
    return defaults | overrides


def test_saved_config_reads_back_to_the_same_settings(tmp_path):
    arguments = fit_arguments(
        updates=3,
        model=ModelSettings(lora=LoraSettings(r=8, alpha=16)),
        rollout=RolloutSettings(prompts_per_update=2, task_names=["count-lines"], cpus=[0]),
        algorithm=AlgorithmSettings(optimizer=OptimizerSettings(lr=3e-4, betas=(0.8, 0.99)), max_grad_norm=2.0),
        callbacks=[StalenessMonitor(max_policy_lag=2), MFUMonitor(available_flops=1e11, window=4)],
        overwrite=True,
        out_dir=str(tmp_path / "run"),
    )
    config = resolved_config(arguments)
    json.dumps(config)  # plain data: it also goes into every checkpoint's meta.json
    assert list(config) == list(inspect.signature(fit).parameters)
    assert config["overwrite"] is False  # re-running a saved config never replaces the run it came from
    assert config["algorithm"]["optimizer"]["betas"] == [0.8, 0.99]
    assert config["callbacks"][0] == {
        "class_path": "tslightning.callbacks.staleness_monitor.StalenessMonitor",
        "init_args": {"max_policy_lag": 2},
    }
    saved = tmp_path / "config.yaml"
    saved.write_text(config_yaml(config, "a header\nof two lines"))
    assert saved.read_text().startswith("# a header\n# of two lines\n")

    parser = cli.parser()
    settings = parser.instantiate(parser.parse_args(["fit", "--config", str(saved)])).fit
    assert settings.updates == 3 and settings.out_dir == str(tmp_path / "run") and settings.overwrite is False
    assert settings.model == arguments["model"] and settings.rollout == arguments["rollout"]
    assert settings.algorithm == arguments["algorithm"]
    staleness, mfu = settings.callbacks
    assert isinstance(staleness, StalenessMonitor) and staleness.max_policy_lag == 2
    assert isinstance(mfu, MFUMonitor) and (mfu.available_flops, mfu.window) == (1e11, 4)


def test_an_init_argument_that_cannot_be_read_back_is_named_in_a_warning():
    class Sized:
        def __init__(self, size: int = 3, scale: float = 1.0, clock=len) -> None:
            self.size = size  # scale is used, not kept; clock keeps its default
            self.clock = clock

    with pytest.warns(UserWarning, match=r"init argument\(s\) \['scale'\] cannot be read back"):
        spec = callback_spec(Sized(size=5, scale=2.0))
    assert spec["init_args"] == {"size": 5, "clock": "builtins.len"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callback_spec(StalenessMonitor())["init_args"] == {"max_policy_lag": 0}


def test_plain_data_and_what_has_none():
    class Mode(enum.Enum):
        STEP = "step"

    assert plain({"a": (1, Mode.STEP), "b": [None, True, 2.5]}) == {"a": [1, "step"], "b": [None, True, 2.5]}
    assert plain(json.dumps) == "json.dumps"
    with pytest.raises(ValueError, match="no plain YAML form"):
        plain(lambda: 0)
    with pytest.raises(ValueError, match="no plain YAML form"):
        plain(object())
    assert yaml_text({"interval": Mode.STEP}) == "interval: step\n"  # what --print_config needs for Timer
