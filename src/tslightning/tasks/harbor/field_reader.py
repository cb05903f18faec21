"""The error policy every Harbor reader shares, and typed reads of a file's values.

Every reader of ``harbor/`` reports a file it cannot read as a :class:`HarborFormatError` (a ``ValueError``) whose
message names the file, the key or line, what it must be and, where there is one, the fix: ``DockerfileError``,
``ComposeError``, ``MigrationError`` and :class:`~tslightning.tasks.terminal_task.TaskFormatError` (every problem of
a task directory at once). Inside a read a wrong value is never an exception: :class:`FieldReader` appends one
problem line naming the file and the ``[section] key``, returns a harmless default, and the reader goes on, so that
all problems of a file are reported together.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["FieldReader", "HarborFormatError", "is_number", "where"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG])B?\s*$", re.IGNORECASE)


class HarborFormatError(ValueError):
    """A Harbor file cannot be read; the message names the file, the key or line, and the fix."""


class FieldReader:
    """Typed reads of one file's values; each bad value appends a problem to ``problems``.

    Args:
        file: The file's name, first in every problem (``task.toml``).
        problems: Where problems are appended (shared with the caller).
    """

    def __init__(self, file: str, problems: list[str]) -> None:
        self.file, self.problems = file, problems

    def bad(self, section: str, key: str, expected: str, value: Any) -> None:
        self.problems.append(f"{self.file}: {where(section, key)} must be {expected}; got {value!r}")

    def positive(self, section: str, key: str, value: Any, allow_zero: bool = False) -> float:
        if not is_number(value) or not (value >= 0 if allow_zero else value > 0):
            self.bad(section, key, "a positive number of seconds", value)
            return 1.0
        return float(value)

    def count(self, section: str, key: str, value: Any, minimum: int = 1) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.bad(section, key, f"an integer ≥ {minimum}", value)
            return max(minimum, 1)
        return value

    def boolean(self, section: str, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            self.bad(section, key, "true or false", value)
            return False
        return value

    def string(self, section: str, key: str, value: Any) -> str:
        if not isinstance(value, str):
            self.bad(section, key, "a string", value)
            return ""
        return value

    def user(self, section: str, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str | int) or isinstance(value, bool):
            self.bad(section, "user", "a user name or uid", value)
            return None
        return str(value)

    def absolute_path(self, section: str, key: str, value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not value.startswith("/"):
            self.bad(section, key, "an absolute path", value)
            return None
        return value

    def size_mb(self, section: str, key: str, value: Any) -> int:
        match = _SIZE.match(value) if isinstance(value, str) else None
        if match is None:
            self.bad(section, key, "a size such as '2G' or '512M'", value)
            return 1
        number, unit = float(match.group(1)), match.group(2).upper()
        return max(1, int(number * {"K": 1 / 1024, "M": 1, "G": 1024}[unit]))


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return not isinstance(value, bool) and isinstance(value, int | float)


def where(section: str, key: str) -> str:
    """``[section] key`` (a top-level key alone)."""
    return f"[{section}] {key}" if section else key
