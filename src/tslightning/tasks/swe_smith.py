"""SWE-smith instances from JSONL, as the Hugging Face ``SWE-bench/SWE-smith*`` releases ship them.

One JSON object per line with SWE-smith's fields::

    instance_id        str, e.g. "oauthlib__oauthlib.1fd52536.combine_file__09vlzil6"
    repo               str, the SWE-smith mirror, e.g. "swesmith/oauthlib__oauthlib.1fd52536"
    problem_statement  str, the bug report the agent sees (may be empty in the release: see static_filter)
    patch              str, the *bug-inducing* diff, applied before the agent starts (App. C.1)
    FAIL_TO_PASS       list[str], tests the repair must fix
    PASS_TO_PASS       list[str], tests that must keep passing
    image_name         str, the environment image

``FAIL_TO_PASS`` / ``PASS_TO_PASS`` may also be JSON-encoded lists (SWE-bench's form). Other keys (``base_commit``,
``created_at``, ...) are kept in :attr:`SweSmithInstance.extra`. Structural problems — a line that is not a JSON
object, a missing key, a value of the wrong type — raise one :class:`SweSmithFormatError` naming each line and field.
Empty problem statements and duplicate ids are data, not format errors: :func:`static_filter` removes them as
App. C.2's static filter does.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_STRING_FIELDS = ("instance_id", "repo", "problem_statement", "patch", "image_name")
_TEST_LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")
_MAX_REPORTED_PROBLEMS = 50


class SweSmithFormatError(ValueError):
    """A SWE-smith JSONL file has malformed records; ``problems`` holds ``path:line: field: what`` lines."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = Path(path)
        self.problems = list(problems)
        shown = self.problems[:_MAX_REPORTED_PROBLEMS]
        more = len(self.problems) - len(shown)
        lines = "\n".join(f"  - {problem}" for problem in shown) + (f"\n  ... and {more} more" if more else "")
        super().__init__(f"{self.path}: {len(self.problems)} malformed SWE-smith record field(s):\n{lines}")


@dataclass(frozen=True)
class SweSmithInstance:
    """One SWE-smith repair task.

    Attributes:
        instance_id: Unique id of the instance.
        repo: The SWE-smith mirror repository (``swesmith/<owner>__<name>.<commit>``).
        problem_statement: The bug report shown to the agent.
        patch: The bug-inducing diff applied before the agent starts.
        fail_to_pass: Tests that fail with the bug and must pass after the repair.
        pass_to_pass: Tests that pass with the bug and must still pass.
        image_name: The environment image.
        line: 1-based line of the record in its file.
        extra: Every other key of the record.
    """

    instance_id: str
    repo: str
    problem_statement: str
    patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    image_name: str
    line: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def designated_tests(self) -> tuple[str, ...]:
        """Every test the binary reward requires: ``FAIL_TO_PASS`` then ``PASS_TO_PASS``."""
        return self.fail_to_pass + self.pass_to_pass

    @property
    def group_id(self) -> str:
        """The split group: the original ``owner/name`` repository, lower-cased (App. C.2)."""
        return original_repository(self.repo)


def original_repository(repo: str) -> str:
    """Map a SWE-smith mirror name back to ``owner/name``, case-normalized.

    ``swesmith/pylint-dev__astroid.b114f6b5`` → ``pylint-dev/astroid``; a plain ``owner/name`` passes through.
    """
    name = repo.strip()
    if name.lower().startswith("swesmith/"):
        name = name.split("/", 1)[1]
    if "__" in name:
        owner, _, rest = name.partition("__")
        name = f"{owner}/{rest.rsplit('.', 1)[0] if '.' in rest else rest}"
    return name.lower()


def load_swe_smith_jsonl(path: str | Path) -> list[SweSmithInstance]:
    """Parse every record of a SWE-smith JSONL file (blank lines skipped); raises :class:`SweSmithFormatError`."""
    path = Path(path)
    instances: list[SweSmithInstance] = []
    problems: list[str] = []
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if text.strip():
                instance = _parse_record(text, number, f"{path.name}:{number}", problems)
                if instance is not None:
                    instances.append(instance)
    if problems:
        raise SweSmithFormatError(path, problems)
    return instances


def static_filter(instances: Iterable[SweSmithInstance]) -> tuple[list[SweSmithInstance], dict[str, str]]:
    """App. C.2's static filter: keep records with a nonempty id, problem statement, repo and image, one per id.

    Returns the kept instances (first occurrence of each id) and ``{"<instance_id>@line <n>": reason}`` for the rest.
    """
    kept: list[SweSmithInstance] = []
    removed: dict[str, str] = {}
    seen: set[str] = set()
    for instance in instances:
        key = f"{instance.instance_id}@line {instance.line}"
        empty = [name for name in ("instance_id", "problem_statement", "repo", "image_name")
                 if not getattr(instance, name).strip()]  # fmt: skip
        if empty:
            removed[key] = f"empty {', '.join(empty)}"
        elif instance.instance_id in seen:
            removed[key] = "duplicate instance_id"
        else:
            seen.add(instance.instance_id)
            kept.append(instance)
    return kept, removed


def _parse_record(text: str, line: int, where: str, problems: list[str]) -> SweSmithInstance | None:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as error:
        problems.append(f"{where}: not valid JSON ({error.msg} at column {error.colno})")
        return None
    if not isinstance(record, dict):
        problems.append(f"{where}: a record must be a JSON object; got {type(record).__name__}")
        return None
    before = len(problems)
    strings = {name: _string_field(record, name, where, problems) for name in _STRING_FIELDS}
    tests = {name: _test_list_field(record, name, where, problems) for name in _TEST_LIST_FIELDS}
    if len(problems) > before:
        return None
    known = set(_STRING_FIELDS) | set(_TEST_LIST_FIELDS)
    return SweSmithInstance(
        **strings,
        fail_to_pass=tests["FAIL_TO_PASS"],
        pass_to_pass=tests["PASS_TO_PASS"],
        line=line,
        extra={key: value for key, value in record.items() if key not in known},
    )


def _string_field(record: dict[str, Any], name: str, where: str, problems: list[str]) -> str:
    if name not in record:
        problems.append(f"{where}: {name}: missing")
        return ""
    value = record[name]
    if not isinstance(value, str):
        problems.append(f"{where}: {name}: must be a string; got {type(value).__name__}")
        return ""
    return value


def _test_list_field(record: dict[str, Any], name: str, where: str, problems: list[str]) -> tuple[str, ...]:
    if name not in record:
        problems.append(f"{where}: {name}: missing")
        return ()
    value = record[name]
    if isinstance(value, str):  # SWE-bench stores these as JSON-encoded lists
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            problems.append(f"{where}: {name}: a string here must be a JSON-encoded list of test ids")
            return ()
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        problems.append(f"{where}: {name}: must be a list of test-id strings; got {value!r:.60}")
        return ()
    return tuple(value)
