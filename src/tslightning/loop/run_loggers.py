"""Where ``fit``'s metrics go: Lightning loggers given as ``class_path``/``init_args``, as LightningCLI takes
``trainer.logger``.

Any Lightning logger works — Fabric's ``CSVLogger`` and ``TensorBoardLogger`` (the default pair), and the Trainer's
``WandbLogger``, ``MLFlowLogger``, ``CometLogger``, ... (a Trainer logger is a Fabric logger too). A bare class name
is looked up in ``lightning.fabric.loggers``, then ``lightning.pytorch.loggers``. A logger's directory argument
(``root_dir`` or ``save_dir``) defaults to the run's ``out_dir`` (MLflow's file store to ``out_dir/mlruns``), so a
run's logs stay with its checkpoints and ``--overwrite`` removes them with the run.

``fit`` takes the specs as plain mappings (``{"class_path": ..., "init_args": {...}}``), not instances: the resolved
config records each logger exactly as given, and the loggers are built only after every check passed
(:func:`logger_problems` checks the class, its arguments and its package without building anything: MLflow's
logger, for one, opens its store when built).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import Logger

_SEARCHED = ("lightning.fabric.loggers", "lightning.pytorch.loggers")
"""Where a bare class name (``WandbLogger``) is looked up, in order."""

_PACKAGES = {"WandbLogger": "wandb", "MLFlowLogger": "mlflow", "CometLogger": "comet_ml", "NeptuneLogger": "neptune"}
"""The package (import name) a logger needs; tslightning has a ``wandb`` and an ``mlflow`` extra."""


@dataclass
class LoggerSpec:
    """One logger, as LightningCLI's ``trainer.logger`` takes it."""

    class_path: str
    """The logger class: an import path (``lightning.pytorch.loggers.WandbLogger``) or a Lightning logger's name
    (``WandbLogger``, ``MLFlowLogger``, ``CSVLogger``, ``TensorBoardLogger``)."""
    init_args: dict[str, Any] = field(default_factory=dict)
    """Its constructor's arguments; ``root_dir``/``save_dir`` default to ``out_dir`` (MLflow's: ``out_dir/mlruns``)."""

    @classmethod
    def parse(cls, spec: Mapping[str, Any], index: int) -> LoggerSpec:
        """The spec of ``loggers[index]``: a mapping of ``class_path`` and optional ``init_args``.

        Raises:
            ValueError: naming the entry and what is wrong with it.
        """
        unknown = sorted(set(spec) - {"class_path", "init_args"})
        if not isinstance(spec.get("class_path"), str) or unknown:
            raise ValueError(
                f"loggers[{index}] must be {{class_path: ..., init_args: {{...}}}}; got keys {sorted(spec)}"
            )
        init_args = spec.get("init_args") or {}
        if not isinstance(init_args, Mapping):
            raise ValueError(f"loggers[{index}].init_args must be a mapping; got {init_args!r}")
        return cls(spec["class_path"], dict(init_args))


DEFAULT_LOGGERS = (
    {"class_path": "CSVLogger", "init_args": {"name": "csv"}},
    {"class_path": "TensorBoardLogger", "init_args": {"name": "tensorboard"}},
)
"""CSV and TensorBoard under ``out_dir`` (``out_dir/csv``, ``out_dir/tensorboard``)."""


def make_loggers(specs: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[Logger]:
    """The loggers ``specs`` name, their directories defaulting to ``out_dir``.

    Raises:
        ValueError: naming every logger that cannot be built and why (see :func:`logger_problems`).
    """
    problems = logger_problems(specs, out_dir)
    if problems:
        raise ValueError("; ".join(problems))
    loggers = []
    for index, given in enumerate(specs):
        spec = LoggerSpec.parse(given, index)
        cls = logger_class(spec.class_path)
        try:
            loggers.append(cls(**_with_directory(cls, spec.init_args, Path(out_dir))))
        except Exception as error:  # the logger's own refusal (e.g. MLflow's store), named like the checks
            raise ValueError(f"loggers[{index}] {spec.class_path}: {type(error).__name__}: {error}") from error
    return loggers


def logger_problems(specs: Sequence[Mapping[str, Any]], out_dir: str | Path) -> list[str]:
    """Each logger that cannot be built — unknown class, not a Lightning logger, arguments its constructor does not
    take, its package missing — one line each, naming ``loggers[i]`` and the fix. Builds nothing."""
    problems = []
    for index, given in enumerate(specs):
        try:
            spec = LoggerSpec.parse(given, index)
        except ValueError as error:
            problems.append(str(error))
            continue
        problem = _spec_problem(spec, Path(out_dir))
        if problem is not None:
            problems.append(f"loggers[{index}] {spec.class_path}: {problem}")
    return problems


def _spec_problem(spec: LoggerSpec, out_dir: Path) -> str | None:
    try:
        cls = logger_class(spec.class_path)
    except ImportError as error:
        return f"{error}; install its package"
    except ValueError as error:
        return str(error)
    package = _PACKAGES.get(cls.__name__)
    if package is not None and importlib.util.find_spec(package) is None:
        return f"needs the {package} package: pip install -e '.[{package}]'"
    try:
        inspect.signature(cls).bind(**_with_directory(cls, spec.init_args, out_dir))
    except TypeError as error:
        return f"{error} (init_args are {cls.__name__}'s constructor arguments)"
    return None


def logger_class(class_path: str) -> type[Logger]:
    """The class ``class_path`` names (an import path, or a Lightning logger's bare name).

    Raises:
        ValueError: if it names no class, or one that is not a Lightning logger.
    """
    if "." in class_path:
        module, _, name = class_path.rpartition(".")
        candidates = [(module, name)]
    else:
        candidates = [(module, class_path) for module in _SEARCHED]
    for module, name in candidates:
        cls = getattr(importlib.import_module(module), name, None)
        if cls is None:
            continue
        if not (inspect.isclass(cls) and issubclass(cls, Logger)):
            raise ValueError(f"{class_path} is not a Lightning logger (lightning.fabric.loggers.Logger)")
        return cls
    raise ValueError(f"no logger class {class_path}: give an import path or one of Lightning's loggers, e.g. CSVLogger")


def _with_directory(cls: type, init_args: dict[str, Any], out_dir: Path) -> dict[str, Any]:
    """``init_args`` with the logger's directory argument set to ``out_dir`` when it is not given."""
    parameters = inspect.signature(cls).parameters
    for name in ("root_dir", "save_dir"):
        if name in parameters and name not in init_args:
            directory = out_dir / "mlruns" if cls.__name__ == "MLFlowLogger" else out_dir
            return {name: str(directory), **init_args}
    return dict(init_args)
