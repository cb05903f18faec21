"""The SHA-256 train / dev split by group (App. C.2)."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import pytest

from tslightning.tasks import split as split_module
from tslightning.tasks.split import DEV_FRACTION, group_digest, normalize_group_id, split_groups, split_of
from tslightning.tasks.swe_smith import original_repository
from tslightning.tasks.terminal_task import seta_source_family


def test_digest_is_sha256_of_the_normalized_id():
    assert normalize_group_id("  Pylint-Dev/Astroid \n") == "pylint-dev/astroid"
    assert group_digest("Pylint-Dev/Astroid") == hashlib.sha256(b"pylint-dev/astroid").hexdigest()


def test_split_of_is_stable_across_processes_and_hash_seeds():
    ids = [f"family-{i}" for i in range(50)]
    here = [split_of(group_id) for group_id in ids]
    # Load split.py on its own (no torch import through the package) in fresh interpreters with other hash seeds.
    code = (
        "import importlib.util, sys; spec = importlib.util.spec_from_file_location('split', sys.argv[1]); "
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        "print(','.join(m.split_of(f'family-{i}') for i in range(50)))"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code, split_module.__file__],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed},
        ).stdout.strip()
        assert out.split(",") == here


def test_split_of_pins_known_values():
    # Pinned digests (first 48 bits → position in [0, 1)): any change of normalization or hashing shows up here.
    assert group_digest("Pallets/Jinja").startswith("552a56d27cac")  # 0.3327
    assert group_digest("django/django").startswith("73cf18b90381")  # 0.4524
    assert split_of("Pallets/Jinja", 0.34) == "dev" and split_of("pallets/jinja", 0.33) == "train"
    assert split_of("django/django", 0.46) == "dev" and split_of("django/django", 0.45) == "train"
    assert split_of("anything", 0.0) == "train" and split_of("anything", 1.0) == "dev"


@pytest.mark.parametrize("fraction", [0.05, 0.2, 0.5])
def test_split_of_rough_fraction(fraction):
    n = 20_000
    dev = sum(split_of(f"repo-{i}", fraction) == "dev" for i in range(n))
    sigma = math.sqrt(n * fraction * (1 - fraction))
    assert abs(dev - n * fraction) < 5 * sigma


def test_split_groups_takes_the_ceiling_of_smallest_digests():
    ids = [f"family-{i}" for i in range(3474)]  # Table 4: 3,474 SETA source families → 174 dev
    splits = split_groups(ids)
    dev = [group_id for group_id in ids if splits[group_id] == "dev"]
    assert len(dev) == 174 == math.ceil(DEV_FRACTION * 3474)
    cutoff = max(group_digest(group_id) for group_id in dev)
    assert all(group_digest(group_id) > cutoff for group_id in ids if splits[group_id] == "train")
    assert list(split_groups([f"r{i}" for i in range(131)]).values()).count("dev") == 7  # 131 repos → 7 dev


def test_split_groups_exact_decimal_fraction_and_order_independence():
    ids = [f"x{i}" for i in range(100)]
    assert list(split_groups(ids, 0.07).values()).count("dev") == 7  # not 8 from 0.07 * 100 = 7.000000000000001
    assert split_groups(list(reversed(ids)), 0.07) == split_groups(ids, 0.07)


def test_split_groups_merges_ids_of_one_group():
    splits = split_groups(["Owner/Repo", "owner/repo", "other/x"], 0.5)
    assert splits["Owner/Repo"] == splits["owner/repo"]
    assert list(splits.values()).count("dev") in (1, 2)  # one of the two groups is dev


def test_consistency_between_split_of_and_split_groups():
    ids = [f"g{i}" for i in range(2000)]
    per_id = {group_id for group_id in ids if split_of(group_id, 0.1) == "dev"}
    ranked = split_groups(ids, 0.1)
    # Both take the smallest digests: one dev set contains the other.
    exact = {group_id for group_id, split in ranked.items() if split == "dev"}
    assert per_id <= exact or exact <= per_id


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="dev_fraction"):
        split_of("x", 1.5)
    with pytest.raises(ValueError, match="empty"):
        split_of("   ")
    with pytest.raises(TypeError, match="group_id"):
        split_of(3)


def test_dataset_group_ids():
    assert original_repository("swesmith/pylint-dev__astroid.b114f6b5") == "pylint-dev/astroid"
    assert original_repository("SWESmith/Pallets__Jinja.ada0a9a6") == "pallets/jinja"
    assert original_repository("oauthlib/oauthlib") == "oauthlib/oauthlib"
    assert seta_source_family("ask_ubuntu__123__b1") == "ask_ubuntu__123"
    assert seta_source_family("nl2bash__42__d2") == "nl2bash__42"
    assert seta_source_family("nl2bash__42") == "nl2bash__42"
