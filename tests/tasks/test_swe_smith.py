"""SWE-smith JSONL records: typed fields, errors naming line and field, App. C.2's static filter."""

from __future__ import annotations

import json

import pytest

from tslightning.tasks.split import split_of
from tslightning.tasks.swe_smith import SweSmithFormatError, load_swe_smith_jsonl, static_filter


def _record(**overrides):
    record = {
        "instance_id": "pylint-dev__astroid.b114f6b5.pr_1234",
        "repo": "swesmith/pylint-dev__astroid.b114f6b5",
        "problem_statement": "Inference of `x` crashes.",
        "patch": "diff --git a/astroid/x.py b/astroid/x.py\n",
        "FAIL_TO_PASS": ["tests/test_inference.py::test_case"],
        "PASS_TO_PASS": ["tests/test_inference.py::test_other", "tests/test_x.py::test_y"],
        "image_name": "swebench/swesmith.x86_64.pylint-dev__astroid.b114f6b5",
        "base_commit": "0123abcd",
    }
    record.update(overrides)
    return record


def _write(tmp_path, *lines):
    path = tmp_path / "instances.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_loads_typed_records(tmp_path):
    swe_bench_style = _record(instance_id="b", FAIL_TO_PASS=json.dumps(["t::a"]), PASS_TO_PASS="[]")
    (first, second) = load_swe_smith_jsonl(_write(tmp_path, _record(), "", swe_bench_style))
    assert first.instance_id == "pylint-dev__astroid.b114f6b5.pr_1234" and first.line == 1
    assert first.fail_to_pass == ("tests/test_inference.py::test_case",)
    assert first.designated_tests == first.fail_to_pass + first.pass_to_pass and len(first.designated_tests) == 3
    assert first.extra == {"base_commit": "0123abcd"}
    assert first.group_id == "pylint-dev/astroid" and split_of(first.group_id) in ("train", "dev")
    assert second.line == 3 and second.fail_to_pass == ("t::a",) and second.pass_to_pass == ()


def test_errors_name_line_and_field(tmp_path):
    missing = _record()
    del missing["patch"]
    path = _write(
        tmp_path,
        _record(),
        missing,
        _record(FAIL_TO_PASS="tests/x.py::t"),
        _record(PASS_TO_PASS=[1, 2], repo=7),
        "{truncated",
        "[1, 2]",
    )
    with pytest.raises(SweSmithFormatError) as info:
        load_swe_smith_jsonl(path)
    problems = info.value.problems
    assert "instances.jsonl:2: patch: missing" in problems
    assert "instances.jsonl:3: FAIL_TO_PASS: a string here must be a JSON-encoded list of test ids" in problems
    assert "instances.jsonl:4: repo: must be a string; got int" in problems
    assert any(problem.startswith("instances.jsonl:4: PASS_TO_PASS: must be a list") for problem in problems)
    assert any(problem.startswith("instances.jsonl:5: not valid JSON") for problem in problems)
    assert "instances.jsonl:6: a record must be a JSON object; got list" in problems
    assert len(problems) == 6 and "6 malformed" in str(info.value)


def test_static_filter_drops_empty_statements_and_duplicates(tmp_path):
    path = _write(
        tmp_path,
        _record(instance_id="a"),
        _record(instance_id="b", problem_statement="   "),
        _record(instance_id="a", problem_statement="again"),
        _record(instance_id="c", image_name=""),
        _record(instance_id="d"),
    )
    kept, removed = static_filter(load_swe_smith_jsonl(path))
    assert [instance.instance_id for instance in kept] == ["a", "d"]
    assert removed == {
        "b@line 2": "empty problem_statement",
        "a@line 3": "duplicate instance_id",
        "c@line 4": "empty image_name",
    }
