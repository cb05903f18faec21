"""How each value of a compose file is read, as ``docker compose`` reads it: durations, command lists,
``environment`` lists and mappings, ``depends_on`` conditions, healthchecks, ``extra_hosts``
(:mod:`~tslightning.tasks.harbor.compose_project` reads the file)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any

from tslightning.tasks.harbor.field_reader import HarborFormatError

CONDITIONS = ("service_started", "service_healthy", "service_completed_successfully")
"""``depends_on`` conditions."""
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(us|ms|h|m|s)")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


class ComposeError(HarborFormatError):
    """The compose file cannot be read (the message names the file and the key)."""


@dataclass(frozen=True)
class Healthcheck:
    """A service's ``healthcheck`` (Docker's defaults), its test as one shell command."""

    command: str
    interval_s: float = 30.0
    timeout_s: float = 30.0
    retries: int = 3
    start_period_s: float = 0.0
    start_interval_s: float = 5.0


def optional_str(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool | dict | list):
        raise ComposeError(f"{key} must be a string")
    return str(value)


def words(value: Any, key: str) -> tuple[str, ...] | None:
    """A ``command`` / ``entrypoint``: a list as given; a string split as compose splits it (no shell)."""
    if value is None:
        return None
    if isinstance(value, list):
        return tuple(str(item) for item in value)
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as error:
            raise ComposeError(f"{key}: {error}") from error
    raise ComposeError(f"{key} must be a string or a list")


def mapping(value: Any, key: str) -> dict[str, str]:
    """``environment`` as a mapping (a ``NAME=value`` list, or a mapping; a bare ``NAME`` is unset, as compose takes
    it from a shell environment this file is not given)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return {
            str(k): "" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()
        }
    if isinstance(value, list):
        pairs = [str(item).split("=", 1) for item in value]
        return {pair[0].strip(): pair[1] for pair in pairs if len(pair) == 2}
    raise ComposeError(f"{key}.environment must be a list or a mapping")


def depends_on(value: Any, key: str) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, list):
        return {str(name): "service_started" for name in value}
    if not isinstance(value, dict):
        raise ComposeError(f"{key} must be a list or a mapping")
    conditions = {}
    for name, spec in value.items():
        condition = (spec or {}).get("condition", "service_started") if isinstance(spec, dict) else "service_started"
        if condition not in CONDITIONS:
            raise ComposeError(f"{key}.{name}.condition must be one of {list(CONDITIONS)} (got {condition!r})")
        conditions[str(name)] = condition
    return conditions


def healthcheck(value: Any, key: str) -> Healthcheck | None:
    if not isinstance(value, dict) or value.get("disable"):
        return None
    test = value.get("test")
    if isinstance(test, str):
        command = test
    elif isinstance(test, list) and test and test[0] in ("CMD", "CMD-SHELL", "NONE"):
        if test[0] == "NONE":
            return None
        command = shlex.join(test[1:]) if test[0] == "CMD" else " ".join(str(part) for part in test[1:])
    else:
        raise ComposeError(f"{key}.test must be a string or a list starting with CMD, CMD-SHELL or NONE")
    durations = {name: _seconds(value[name], f"{key}.{name}") for name in _HEALTH_DURATIONS if name in value}
    retries = value.get("retries", 3)
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 1:
        raise ComposeError(f"{key}.retries must be an integer >= 1 (got {retries!r})")
    return Healthcheck(command, retries=retries, **{_HEALTH_DURATIONS[k]: v for k, v in durations.items()})


_HEALTH_DURATIONS = {
    "interval": "interval_s",
    "timeout": "timeout_s",
    "start_period": "start_period_s",
    "start_interval": "start_interval_s",
}


def _seconds(value: Any, key: str) -> float:
    """A compose duration (``2s``, ``1m30s``, ``500ms``; a bare number is seconds) in seconds."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    text = str(value).strip()
    parts = _DURATION.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        raise ComposeError(f"{key}: {value!r} is not a duration (e.g. 2s, 1m30s, 500ms)")
    return sum(float(number) * _UNITS[unit] for number, unit in parts)


def extra_hosts(value: Any, key: str) -> tuple[tuple[str, str], ...]:
    entries = value.items() if isinstance(value, dict) else [_split_host(str(item), key) for item in value or []]
    return tuple((str(name), str(address)) for name, address in entries)


def _split_host(entry: str, key: str) -> tuple[str, str]:
    for separator in ("=", ":"):
        if separator in entry:
            name, address = entry.split(separator, 1)
            return name, address
    raise ComposeError(f"{key}: {entry!r} is not NAME:ADDRESS")


__all__ = [
    "CONDITIONS",
    "ComposeError",
    "Healthcheck",
    "depends_on",
    "extra_hosts",
    "healthcheck",
    "mapping",
    "optional_str",
    "words",
]
