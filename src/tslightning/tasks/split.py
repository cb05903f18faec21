"""The deterministic train / development split by group (App. C.2).

Tasks are split by *group* so related tasks never straddle the split: a repository for SWE-smith
(:attr:`tslightning.tasks.swe_smith.SweSmithInstance.group_id`), a source family for SETA
(:func:`tslightning.tasks.terminal_task.seta_source_family`). Groups are ordered by the SHA-256 digest of their
normalized identifier and the first ones form the development set, so the split depends only on the task list —
never on the model, the machine, the Python hash seed or how long trajectories took.

Two forms share that order:

- :func:`split_groups` is the paper's rule for a complete group list: the ``ceil(dev_fraction · n)`` groups with the
  smallest digests are ``dev``.
- :func:`split_of` decides one group on its own: ``dev`` when its digest, read as a number in [0, 1), is below
  ``dev_fraction``. Membership never changes when other groups are added, and the dev share is ``dev_fraction`` in
  expectation rather than exactly.
"""

from __future__ import annotations

import hashlib
import math
import unicodedata
from collections.abc import Iterable
from fractions import Fraction
from typing import Literal

Split = Literal["train", "dev"]

DEV_FRACTION = 0.05
"""The paper's development share: 5% of groups, rounded up (App. C.2)."""


def normalize_group_id(group_id: str) -> str:
    """The form that is hashed: Unicode NFC, surrounding whitespace stripped, case folded."""
    if not isinstance(group_id, str):
        raise TypeError(f"group_id must be a str; got {type(group_id).__name__}")
    normalized = unicodedata.normalize("NFC", group_id).strip().casefold()
    if not normalized:
        raise ValueError("group_id is empty after normalization")
    return normalized


def group_digest(group_id: str) -> str:
    """Hex SHA-256 of the UTF-8 bytes of the normalized group id."""
    return hashlib.sha256(normalize_group_id(group_id).encode("utf-8")).hexdigest()


def split_of(group_id: str, dev_fraction: float = DEV_FRACTION) -> Split:
    """``dev`` when the group's digest, as a fraction of 2**256, is below ``dev_fraction``; else ``train``."""
    _check_fraction(dev_fraction)
    return "dev" if int(group_digest(group_id), 16) < _exact(dev_fraction) * 2**256 else "train"


def split_groups(group_ids: Iterable[str], dev_fraction: float = DEV_FRACTION) -> dict[str, Split]:
    """App. C.2's split of a complete group list: the ``ceil(dev_fraction · n)`` smallest digests are ``dev``.

    Ids that normalize to the same group are one group. Returns each given id's split.
    """
    _check_fraction(dev_fraction)
    ids = list(group_ids)
    digests = {normalize_group_id(group_id): group_digest(group_id) for group_id in ids}
    ordered = sorted(digests, key=digests.__getitem__)
    dev = set(ordered[: math.ceil(_exact(dev_fraction) * len(ordered))])
    return {group_id: ("dev" if normalize_group_id(group_id) in dev else "train") for group_id in ids}


def _exact(dev_fraction: float) -> Fraction:
    # The decimal the user wrote (0.07 → 7/100): float products like 0.07 * 100 = 7.000000000000001 would round up.
    return Fraction(repr(dev_fraction))


def _check_fraction(dev_fraction: float) -> None:
    if not 0.0 <= dev_fraction <= 1.0:
        raise ValueError(f"dev_fraction must be in [0, 1]; got {dev_fraction!r}")
