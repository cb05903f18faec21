"""Every dated experiment in benchmarks/ still imports what it measures and answers ``--help`` (what each measures
is in benchmarks/README.md; their figures live in the docs, never in tests)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def test_each_benchmark_has_a_row_in_the_readme():
    readme = (BENCHMARKS / "README.md").read_text()
    assert SCRIPTS and all(f"`{script.name}`" in readme for script in SCRIPTS)


@pytest.mark.parametrize("script", SCRIPTS, ids=[script.stem for script in SCRIPTS])
def test_each_benchmark_answers_help(script, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(script), "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(script), run_name="__main__")
    assert exited.value.code == 0
    assert "usage:" in capsys.readouterr().out
