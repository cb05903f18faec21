"""Task rewards (App. E.1) and the verifier's reward files.

Two reward schemes, both functions of the fraction ``p`` of the verifier's tests that passed:

- ``binary`` (SWE-style): 1 when every designated test passes, else 0.
- ``seta`` (SETA's partial-progress reward): ``r = p + 0.5·1[p = 1]``, so a full pass earns 1.5.

A verifier reports ``p`` in ``/logs/verifier/`` through one of two files; ``reward.json`` wins when both exist:

``reward.json``
    A JSON object with the test counts ``{"tests_passed": k, "tests_total": n}`` (integers, ``0 ≤ k ≤ n``,
    ``n ≥ 1``; ``p = k / n``), or Harbor's rewards by name: ``{"reward": x}``, or several named rewards
    (``{"correctness": 1.0, "performance": 0.4}``). The reward key the trainer chooses (``reward_key``, default
    ``reward``) is read as ``p`` (a number in [0, 1]); with the default key, counts win over a ``reward`` beside
    them, which is kept as :attr:`RewardReading.reported_reward` for logs (the trainer's scheme decides the reward).
    Every named number is kept in :attr:`RewardReading.named`; other keys are ignored.
``reward.txt``
    One number in [0, 1]: the fraction passed (Terminal-Bench's ``1``/``0`` are the all-or-nothing case).

A missing, unreadable or malformed file never raises and never passes silently: it scores 0 and
:attr:`RewardReading.error` says what was wrong.

**Integrity.** A verifier may execute code the agent wrote, as the same user, in the same ``/logs/verifier``. The
reader therefore accepts only what an honest verifier leaves: a log directory that is still an owner-writable
directory; reward files that are regular files (not symlinks, directories or FIFOs: opened with ``O_NOFOLLOW`` and
without blocking) with one link and owner read and write permission, as a plain write leaves them; and when both
files exist, the same pass fraction in each (an honest verifier writes both from the same counts, so a file forged
beside the verifier's own, or a verifier write that failed on a file forged before it, disagrees). ``reward.txt``
stands for ``reward.json``'s counts, else its ``reward``, else the chosen named reward. Anything else
scores 0 with a reason. What the sandbox adds (a fresh, empty directory per verification, read-only tests, every
process of the verifier gone before the files are read, orphans' writes detected) is in
:mod:`tslightning.tasks.verifier`.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

RewardScheme = Literal["binary", "seta"]
"""How the pass fraction becomes a reward: ``binary`` (SWE-style) or ``seta`` (partial progress)."""

REWARD_TXT = "reward.txt"
REWARD_JSON = "reward.json"
MAX_REWARD_FILE_BYTES = 64 * 1024
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects accepted in ``reward.json`` (the documented shapes need 1)."""
MAX_INT_DIGITS = 18
"""Longest integer accepted in ``reward.json``: test counts, far below Python's 4300-digit conversion limit."""
DEFAULT_REWARD_KEY = "reward"
"""The reward of ``reward.json`` read as the pass fraction unless the trainer chooses another (Harbor's 1-D key)."""
EVERY_NAMED_REWARD = "*"
"""The reward key ``tasks validate`` reads when none was chosen: counts, else ``reward``, else -- for a verifier that
writes only named rewards (``{"correctness": 1, "performance": 1}``) -- every one of them, the smallest read as the
pass fraction, so a task passes only when each named reward is full."""
FRACTION_TOLERANCE = 1e-6
"""How closely ``reward.txt`` and ``reward.json`` must agree when both exist (``reward.txt`` is often ``%.6f``)."""


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
        changed_ns: When the reward files last changed (their latest ``st_ctime_ns``, which no process can set),
            ``None`` when none was read.
        named: Every named number of ``reward.json`` (Harbor's rewards by name).
        key: The reward key read as the pass fraction.
        txt_fraction: What ``reward.txt`` must say beside this ``reward.json`` (counts, else ``reward``, else the
            chosen key); ``None`` for a reading of ``reward.txt`` itself.
    """

    passed_fraction: float | None
    tests_passed: int | None = None
    tests_total: int | None = None
    reported_reward: float | None = None
    source: str | None = None
    error: str | None = None
    changed_ns: int | None = None
    named: dict[str, float] = field(default_factory=dict)
    key: str = DEFAULT_REWARD_KEY
    txt_fraction: float | None = None

    def reward(self, scheme: RewardScheme) -> float:
        """The reward under ``scheme``; 0.0 when the files were missing or malformed."""
        return 0.0 if self.passed_fraction is None else reward_for(self.passed_fraction, scheme)

    def describe(self) -> str:
        """One line for tables and logs: the counts or fraction, or the error."""
        if self.error is not None:
            return self.error
        if self.tests_total is not None and self.key == DEFAULT_REWARD_KEY:
            return f"{self.tests_passed}/{self.tests_total} tests passed ({self.source})"
        if self.key == EVERY_NAMED_REWARD:
            listed = ", ".join(f"{name} {value:g}" for name, value in sorted(self.named.items()))
            return f"every named reward ({listed}): pass fraction {self.passed_fraction:g} ({self.source})"
        if self.key != DEFAULT_REWARD_KEY:
            return f"{self.key} {self.passed_fraction:g} ({self.source})"
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


def parse_reward_json(text: str, key: str = DEFAULT_REWARD_KEY) -> RewardReading:
    """Parse ``reward.json`` (see the module docstring for the accepted shapes), reading ``key`` as the pass
    fraction; malformed text of any kind (deep nesting, huge numbers, ``NaN``) raises :class:`RewardFileError`."""
    depth = _nesting_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise RewardFileError(f"{REWARD_JSON} nests {depth} levels of arrays or objects; at most {MAX_JSON_DEPTH}")
    try:
        data = json.loads(text, parse_int=_bounded_int)
    except json.JSONDecodeError as error:
        raise RewardFileError(f"{REWARD_JSON} is not valid JSON ({error.msg} at line {error.lineno})") from None
    except RewardFileError:
        raise
    except (RecursionError, ValueError) as error:
        raise RewardFileError(f"{REWARD_JSON} cannot be read as JSON ({_preview(str(error))})") from None
    if not isinstance(data, dict):
        raise RewardFileError(f"{REWARD_JSON} must be a JSON object; got {type(data).__name__}")
    named = _named_rewards(data)
    counts = _reading_from_counts(data) if "tests_passed" in data or "tests_total" in data else None
    if key == EVERY_NAMED_REWARD:
        if counts is None and DEFAULT_REWARD_KEY not in data and named:
            return _every_named(named)
        key = DEFAULT_REWARD_KEY
    if counts is not None and key == DEFAULT_REWARD_KEY:
        return replace(counts, named=named, txt_fraction=counts.passed_fraction)
    if key not in data:
        raise RewardFileError(_missing_key(key, data))
    fraction = _fraction_in_range(_number(data[key], key), f"{REWARD_JSON} {key!r}")
    primary = counts.passed_fraction if counts is not None else named.get(DEFAULT_REWARD_KEY, fraction)
    base = counts if counts is not None else RewardReading(passed_fraction=fraction, source=REWARD_JSON)
    return replace(base, passed_fraction=fraction, named=named, key=key, txt_fraction=primary)


def _named_rewards(data: dict) -> dict[str, float]:
    """The finite numbers of ``data`` by key (Harbor's named rewards; counts are numbers too)."""
    return {
        str(name): float(value)
        for name, value in data.items()
        if not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    }


def _every_named(named: dict[str, float]) -> RewardReading:
    """The reading of :data:`EVERY_NAMED_REWARD`: each named reward must be a fraction; the smallest is read."""
    fractions = {name: _fraction_in_range(value, f"{REWARD_JSON} {name!r}") for name, value in named.items()}
    smallest = min(fractions.values())
    return RewardReading(
        passed_fraction=smallest, source=REWARD_JSON, named=named, key=EVERY_NAMED_REWARD, txt_fraction=smallest
    )


def choose_reward_key(named: dict[str, float]) -> str:
    """What to do about a ``reward.json`` of named rewards without a ``reward``: name them, and the option."""
    return (
        f"{REWARD_JSON} has named rewards {sorted(named)} but no 'reward'; choose the one to train on "
        "(rollout.reward_key, or --reward_key)"
    )


def _missing_key(key: str, data: dict) -> str:
    if key == DEFAULT_REWARD_KEY and _named_rewards(data):
        return choose_reward_key(_named_rewards(data))
    if key == DEFAULT_REWARD_KEY:
        return f"{REWARD_JSON} needs 'tests_passed' and 'tests_total', or 'reward'; got keys {sorted(data) or 'none'}"
    return f"{REWARD_JSON} has no reward {key!r} (the reward key chosen); got keys {sorted(data) or 'none'}"


def read_reward_files(logs_dir: Path, key: str = DEFAULT_REWARD_KEY) -> RewardReading:
    """Read the verifier's reward from ``logs_dir`` (``reward.json`` first, then ``reward.txt``), with ``key`` the
    named reward read as the pass fraction; never raises.

    Both files are checked when both exist (see "Integrity" in the module docstring); neither is ever followed
    through a symbolic link, and the host never blocks on what it opens.
    """
    try:
        directory = os.open(logs_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        return RewardReading(passed_fraction=None, error=f"cannot open the verifier's log directory: {error}")
    try:
        mode = stat.S_IMODE(os.fstat(directory).st_mode)
        if mode & stat.S_IRWXU != stat.S_IRWXU:
            error = f"the verifier's log directory had its permissions changed (mode {mode:o}); refused"
            return RewardReading(passed_fraction=None, error=error)
        readers = ((REWARD_JSON, lambda text: parse_reward_json(text, key)), (REWARD_TXT, parse_reward_txt))
        readings = [_read_one(directory, name, parse) for name, parse in readers]
    finally:
        os.close(directory)
    return _combine([reading for reading in readings if reading is not None])


def _read_one(directory: int, name: str, parse) -> RewardReading | None:
    """One reward file's reading, None when it is absent."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            return _refused(name, "is a symbolic link")
        return RewardReading(passed_fraction=None, source=name, error=f"cannot read {name}: {error}")
    try:
        info = os.fstat(fd)
        problem = _tampered(info)
        if problem is not None:
            return _refused(name, problem)
        data = os.read(fd, MAX_REWARD_FILE_BYTES + 1)
    except OSError as error:
        return RewardReading(passed_fraction=None, source=name, error=f"cannot read {name}: {error}")
    finally:
        os.close(fd)
    try:
        if len(data) > MAX_REWARD_FILE_BYTES:
            raise RewardFileError(f"{name} is larger than {MAX_REWARD_FILE_BYTES} bytes")
        parsed = parse(data.decode("utf-8"))
    except UnicodeDecodeError as error:
        error_text = f"cannot read {name}: not UTF-8 text ({error.reason} at byte {error.start})"
        return RewardReading(passed_fraction=None, source=name, error=error_text, changed_ns=info.st_ctime_ns)
    except RewardFileError as error:
        return RewardReading(passed_fraction=None, source=name, error=str(error), changed_ns=info.st_ctime_ns)
    reading = parsed if isinstance(parsed, RewardReading) else RewardReading(passed_fraction=parsed, source=name)
    return replace(reading, changed_ns=info.st_ctime_ns)


def _tampered(info: os.stat_result) -> str | None:
    """Why a reward file is not what a plain write by the verifier leaves, or None."""
    if not stat.S_ISREG(info.st_mode):
        return "is not a regular file"
    if info.st_nlink != 1:
        return f"has {info.st_nlink} hard links"
    if stat.S_IMODE(info.st_mode) & (stat.S_IRUSR | stat.S_IWUSR) != stat.S_IRUSR | stat.S_IWUSR:
        return f"had its permissions changed (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _refused(name: str, problem: str) -> RewardReading:
    return RewardReading(passed_fraction=None, source=name, error=f"{name} {problem}; refused")


def _combine(readings: list[RewardReading]) -> RewardReading:
    """``reward.json``'s reading (else ``reward.txt``'s), refused when the other file is bad or disagrees."""
    if not readings:
        return RewardReading(passed_fraction=None, error=f"the verifier wrote neither {REWARD_JSON} nor {REWARD_TXT}")
    changed = max((r.changed_ns for r in readings if r.changed_ns is not None), default=None)
    bad = next((r for r in readings if r.error is not None), None)
    if bad is not None:
        return replace(bad, changed_ns=changed)
    first = readings[0]
    said = first.txt_fraction if first.txt_fraction is not None else first.passed_fraction
    for other in readings[1:]:
        if abs(other.passed_fraction - said) > FRACTION_TOLERANCE:
            error = (
                f"{first.source} ({said:g}) and {other.source} ({other.passed_fraction:g}) disagree: "
                "one was not written by the verifier's last write; refused"
            )
            return RewardReading(passed_fraction=None, source=first.source, error=error, changed_ns=changed)
    return replace(first, changed_ns=changed)


def _nesting_depth(text: str) -> int:
    """The deepest nesting of ``[`` / ``{`` outside strings, counted without parsing (so without recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _bounded_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise RewardFileError(f"{REWARD_JSON} holds an integer of {len(digits)} digits; at most {MAX_INT_DIGITS}")
    return int(digits)


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
