"""A run's resolved config: ``fit``'s arguments as plain data that ``tslightning fit --config`` reads back.

Settings dataclasses become mappings, and each extra callback becomes ``class_path``/``init_args`` — the form
jsonargparse reads — with the init arguments read back from the instance (an attribute named like the parameter, or
the same name with a leading underscore, as Lightning's callbacks and ours store them). An argument that cannot be
read back or written as YAML is left out with a warning: the re-run then uses its default.
"""

from __future__ import annotations

import enum
import inspect
import warnings
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import PurePath
from typing import Any

import yaml

PlainData = None | bool | int | float | str | list | dict
"""What a resolved config holds: YAML's and JSON's own types."""


class _NotPlain(ValueError):
    """A value with no faithful YAML form."""


def resolved_config(arguments: Mapping[str, Any]) -> dict[str, PlainData]:
    """``fit``'s arguments (name → value, in signature order) as plain data; ``callbacks`` as class_path/init_args.

    ``overwrite`` is recorded as ``false``: re-running a saved config never replaces the run it came from.
    """
    config = {}
    for name, value in arguments.items():
        if name == "callbacks":
            config[name] = [callback_spec(callback) for callback in value]
        elif name == "overwrite":
            config[name] = False
        else:
            config[name] = plain(value)
    return config


def callback_spec(callback: object) -> dict[str, PlainData]:
    """``{"class_path": ..., "init_args": {...}}`` of a callback instance, as jsonargparse instantiates it."""
    cls = type(callback)
    init_args, unreadable = {}, []
    for name, parameter in inspect.signature(cls).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        value = _attribute(callback, name)
        try:
            if value is _ABSENT:
                raise _NotPlain(f"{cls.__qualname__} keeps no attribute {name!r}")
            init_args[name] = plain(value)
        except _NotPlain:
            if value is not parameter.default:  # the default itself needs no record (e.g. a clock function)
                unreadable.append(name)
    if unreadable:
        warnings.warn(
            f"config: {cls.__qualname__}'s init argument(s) {unreadable} cannot be read back from the instance or "
            "written as YAML; the saved config leaves them out, so a re-run uses their defaults",
            stacklevel=2,
        )
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}


def plain(value: Any) -> PlainData:
    """``value`` as YAML/JSON data: dataclasses as mappings, enums as their values, paths as strings, tuples as
    lists, named functions and classes as their import paths.

    Raises:
        ValueError: ``value`` (or something inside it) has no faithful plain form.
    """
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, str | PurePath):
        return str(value)
    if is_dataclass(value) and not isinstance(value, type):
        return plain(asdict(value))
    if isinstance(value, Mapping):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain(item) for item in value]
    if callable(value) and "<" not in getattr(value, "__qualname__", "<"):  # not a lambda nor a local function
        return f"{value.__module__}.{value.__qualname__}"
    raise _NotPlain(f"{value!r} has no plain YAML form")


def config_yaml(config: Mapping[str, PlainData], header: str = "") -> str:
    """``config`` as YAML in its own key order, after ``header`` (each of its lines becomes a ``#`` comment)."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml_text(dict(config))


def yaml_text(data: Any) -> str:
    """YAML as jsonargparse writes it (block style, keys in order), enums written as their values: the dumper of
    ``--print_config`` too, which would otherwise fail on a default such as Lightning's ``Interval.step``."""
    return yaml.dump(data, Dumper=_ConfigDumper, sort_keys=False, default_flow_style=False, allow_unicode=True)


class _ConfigDumper(yaml.SafeDumper):
    """YAML's safe dumper, plus enums (as their values)."""


_ConfigDumper.add_multi_representer(enum.Enum, lambda dumper, value: dumper.represent_data(value.value))


_ABSENT = object()


def _attribute(instance: object, name: str) -> Any:
    for attribute in (name, f"_{name}"):
        if attribute in getattr(instance, "__dict__", {}):
            return instance.__dict__[attribute]
    return _ABSENT
