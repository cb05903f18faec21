"""Task rewards (App. E.1) and the verifier's reward files.

Two reward schemes, both functions of the fraction ``p`` of the verifier's tests that passed:

- ``binary`` (SWE-style): 1 when every designated test passes, else 0.
- ``seta`` (SETA's partial-progress reward): ``r = p + 0.5·1[p = 1]``, so a full pass earns 1.5.

A verifier reports ``p`` in ``/logs/verifier/`` through one of two files; ``reward.json`` wins when both exist:

``reward.json``
    A JSON object with either the test counts ``{"tests_passed": k, "tests_total": n}`` (integers, ``0 ≤ k ≤ n``,
    ``n ≥ 1``; ``p = k / n``) or Harbor's ``{"reward": x}`` with ``x`` in [0, 1], read as ``p``. When the counts are
    present a ``reward`` key beside them is the verifier's own score: it is kept as
    :attr:`RewardReading.reported_reward` for logs but the trainer's scheme decides the reward. Other keys are ignored.
``reward.txt``
    One number in [0, 1]: the fraction passed (Terminal-Bench's ``1``/``0`` are the all-or-nothing case).

A missing, unreadable or malformed file never raises and never passes silently: it scores 0 and
:attr:`RewardReading.error` says what was wrong.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

RewardScheme = Literal["binary", "seta"]
"""How the pass fraction becomes a reward: ``binary`` (SWE-style) or ``seta`` (partial progress)."""

REWARD_TXT = "reward.txt"
REWARD_JSON = "reward.json"
MAX_REWARD_FILE_BYTES = 64 * 1024


def binary_reward(passed_fraction: float) -> float:
    """SWE-style reward: 1.0 only when all designated tests pass (``p = 1``), else 0.0."""
    _check_fraction(passed_fraction)
    return 1.0 if passed_fraction == 1.0 else 0.0


def seta_reward(passed_fraction: float) -> float:
    """SETA's partial-progress reward ``r = p + 0.5·1[p = 1]`` (App. E.1), in [0, 1] ∪ {1.5}."""
    _check_fraction(passed_fraction)
    return passed_fraction + (0.5 if passed_fraction == 1.0 else 0.0)


def reward_for(passed_fraction: float, scheme: RewardScheme) -> float:
    """The reward of pass fraction ``passed_fraction`` under ``scheme``."""
    if scheme == "binary":
        return binary_reward(passed_fraction)
    if scheme == "seta":
        return seta_reward(passed_fraction)
    raise ValueError(f"unknown reward scheme {scheme!r}; expected 'binary' or 'seta'")


def max_reward(scheme: RewardScheme) -> float:
    """The reward of a full pass under ``scheme`` (1.0 binary, 1.5 SETA)."""
    return reward_for(1.0, scheme)


class RewardFileError(ValueError):
    """A reward file's content does not follow the documented format."""


@dataclass(frozen=True)
class RewardReading:
    """What the verifier's reward files say.

    Attributes:
        passed_fraction: Fraction of tests passed, or ``None`` when no valid reward file was found.
        tests_passed: Passed-test count when ``reward.json`` gave counts.
        tests_total: Test count when ``reward.json`` gave counts.
        reported_reward: The verifier's own ``reward`` beside the counts (informational).
        source: The file read (``reward.json`` or ``reward.txt``), ``None`` when neither was usable.
        error: Why no fraction could be read (``None`` when ``passed_fraction`` is set).
    """

    passed_fraction: float | None
    tests_passed: int | None = None
    tests_total: int | None = None
    reported_reward: float | None = None
    source: str | None = None
    error: str | None = None

    def reward(self, scheme: RewardScheme) -> float:
        """The reward under ``scheme``; 0.0 when the files were missing or malformed."""
        return 0.0 if self.passed_fraction is None else reward_for(self.passed_fraction, scheme)

    def describe(self) -> str:
        """One line for tables and logs: the counts or fraction, or the error."""
        if self.error is not None:
            return self.error
        if self.tests_total is not None:
            return f"{self.tests_passed}/{self.tests_total} tests passed ({self.source})"
        return f"pass fraction {self.passed_fraction:g} ({self.source})"


def parse_reward_txt(text: str) -> float:
    """Parse ``reward.txt``: one number in [0, 1], the fraction of tests passed."""
    stripped = text.strip()
    if not stripped:
        raise RewardFileError(f"{REWARD_TXT} is empty; expected one number in [0, 1]")
    try:
        value = float(stripped)
    except ValueError:
        raise RewardFileError(f"{REWARD_TXT} must hold one number in [0, 1]; got {_preview(stripped)}") from None
    return _fraction_in_range(value, f"{REWARD_TXT} value")


def parse_reward_json(text: str) -> RewardReading:
    """Parse ``reward.json`` (see the module docstring for the accepted shapes)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise RewardFileError(f"{REWARD_JSON} is not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise RewardFileError(f"{REWARD_JSON} must be a JSON object; got {type(data).__name__}")
    if "tests_passed" in data or "tests_total" in data:
        return _reading_from_counts(data)
    if "reward" in data:
        fraction = _fraction_in_range(_number(data["reward"], "reward"), f"{REWARD_JSON} 'reward'")
        return RewardReading(passed_fraction=fraction, source=REWARD_JSON)
    raise RewardFileError(
        f"{REWARD_JSON} needs 'tests_passed' and 'tests_total', or 'reward'; got keys {sorted(data) or 'none'}"
    )


def read_reward_files(logs_dir: Path) -> RewardReading:
    """Read the verifier's reward from ``logs_dir`` (``reward.json`` first, then ``reward.txt``); never raises.

    A reward file that is a symbolic link, or larger than :data:`MAX_REWARD_FILE_BYTES`, is refused: the verifier
    may run commands the agent wrote, and the host must not follow them outside the attempt.
    """
    for name, parse in ((REWARD_JSON, parse_reward_json), (REWARD_TXT, parse_reward_txt)):
        path = Path(logs_dir) / name
        if path.is_symlink():
            return RewardReading(passed_fraction=None, source=name, error=f"{name} is a symbolic link; refused")
        if not path.is_file():
            continue
        try:
            with path.open("rb") as file:
                data = file.read(MAX_REWARD_FILE_BYTES + 1)
            if len(data) > MAX_REWARD_FILE_BYTES:
                raise RewardFileError(f"{name} is larger than {MAX_REWARD_FILE_BYTES} bytes")
            parsed = parse(data.decode("utf-8"))
        except (OSError, UnicodeDecodeError) as error:
            return RewardReading(passed_fraction=None, source=name, error=f"cannot read {name}: {error}")
        except RewardFileError as error:
            return RewardReading(passed_fraction=None, source=name, error=str(error))
        if isinstance(parsed, RewardReading):
            return parsed
        return RewardReading(passed_fraction=parsed, source=name)
    return RewardReading(passed_fraction=None, error=f"the verifier wrote neither {REWARD_JSON} nor {REWARD_TXT}")


def _reading_from_counts(data: dict) -> RewardReading:
    missing = [key for key in ("tests_passed", "tests_total") if key not in data]
    if missing:
        raise RewardFileError(f"{REWARD_JSON} has no {missing[0]!r} (both 'tests_passed' and 'tests_total' needed)")
    passed, total = data["tests_passed"], data["tests_total"]
    for key, value in (("tests_passed", passed), ("tests_total", total)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise RewardFileError(f"{REWARD_JSON} {key!r} must be an integer; got {_preview(value)}")
    if total < 1:
        raise RewardFileError(f"{REWARD_JSON} 'tests_total' must be at least 1; got {total}")
    if not 0 <= passed <= total:
        raise RewardFileError(f"{REWARD_JSON} 'tests_passed' must be in [0, tests_total={total}]; got {passed}")
    reported = _number(data["reward"], "reward") if "reward" in data else None
    return RewardReading(
        passed_fraction=passed / total,
        tests_passed=passed,
        tests_total=total,
        reported_reward=reported,
        source=REWARD_JSON,
    )


def _number(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardFileError(f"{REWARD_JSON} {key!r} must be a finite number; got {_preview(value)}")
    return float(value)


def _fraction_in_range(value: float, what: str) -> float:
    if not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise RewardFileError(f"{what} must be a pass fraction in [0, 1]; got {value!r}")
    return value


def _check_fraction(passed_fraction: float) -> None:
    if not 0.0 <= passed_fraction <= 1.0:
        raise ValueError(f"passed_fraction must be in [0, 1]; got {passed_fraction!r}")


def _preview(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
