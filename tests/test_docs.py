"""The documentation site builds with `mkdocs build --strict` (every page in the nav, every API reference resolved
from the docstrings, no broken link), offline; and the README stays a short front page whose test command is CI's."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "loop" / "index.html").is_file()
    assert "AlgorithmSettings" in (tmp_path / "site" / "reference" / "loop" / "index.html").read_text()


def test_the_readme_is_short_and_its_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    commands = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = '.venv/bin/python -m pytest -q -m "slow or not slow"'
    assert any(test_command in block for block in commands) and f"\n{test_command}\n" in ci
    assert shutil.which("bash") and "bash scripts/setup.sh" in ci
