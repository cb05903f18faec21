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


PUBLIC_PACKAGES = ["tslightning", "tslightning.callbacks", "tslightning.tasks", "tslightning.sandbox",
                   "tslightning.loop", "tslightning.rollout.gateway", "tslightning.rollout.harness"]  # fmt: skip
"""The packages whose ``__all__`` users import from: each name needs an entry in the API reference."""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The documentation site, built once with ``mkdocs build --strict``."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    out = tmp_path_factory.mktemp("docs") / "site"
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)]
    done = subprocess.run(build, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_the_docs_site_builds_strictly(site):
    assert (site / "reference" / "loop" / "index.html").is_file()
    assert "AlgorithmSettings" in (site / "reference" / "loop" / "index.html").read_text()


def test_the_built_pages_show_no_sphinx_roles_and_cite_only_the_paper(site):
    """Docstrings' Sphinx roles become cross-references (docs/hooks/sphinx_roles.py); nothing cites a document users
    do not have."""
    found = []
    for page in sorted(site.rglob("*.html")):
        text = page.read_text()
        found += [
            f"{page.relative_to(site)}: {role}" for role in re.findall(r":(?:class|mod|meth|func|attr|data):", text)
        ]
        found += [f"{page.relative_to(site)}: SPEC §" for _ in re.findall("SPEC §", text)]
    assert not found, "\n".join(sorted(set(found))[:20])


def _documented_names(site: Path) -> set[str]:
    ids = set()
    for page in site.rglob("*.html"):
        ids.update(re.findall(r'id="(tslightning\.[\w.]+)"', page.read_text()))
    return {identifier.rsplit(".", 1)[-1] for identifier in ids}


def test_every_public_name_and_every_fit_setting_type_has_an_api_entry(site):
    import dataclasses
    import importlib
    import typing

    documented = _documented_names(site)
    missing = [
        f"{package}.{name}"
        for package in PUBLIC_PACKAGES
        for name in importlib.import_module(package).__all__
        if name not in documented
    ]
    settings: set[type] = set()

    def walk(hint) -> None:  # every dataclass a fit parameter takes, nested settings included
        for candidate in (hint, *typing.get_args(hint)):
            if isinstance(candidate, type) and dataclasses.is_dataclass(candidate) and candidate not in settings:
                settings.add(candidate)
                for field_hint in typing.get_type_hints(candidate).values():
                    walk(field_hint)
            elif candidate is not hint and typing.get_args(candidate):
                walk(candidate)

    for hint in typing.get_type_hints(importlib.import_module("tslightning.loop.fit").fit).values():
        walk(hint)
    assert len(settings) > 10  # the walk reaches the nested settings
    missing += [f"{kind.__module__}.{kind.__qualname__}" for kind in settings if kind.__qualname__ not in documented]
    assert not missing, f"add these to docs/reference/: {sorted(missing)}"


def test_the_readme_is_short_and_its_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    commands = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = '.venv/bin/python -m pytest -q -m "slow or not slow"'
    assert any(test_command in block for block in commands) and f"\n{test_command}\n" in ci
    assert shutil.which("bash") and "bash scripts/setup.sh" in ci


def test_no_docs_page_runs_long_without_a_heading():
    """A reader finds their way by the table of contents: no page goes ~450 words (code blocks aside) without one."""
    long = {}
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        sections = re.split(r"^#{1,6} .*$", text, flags=re.M)
        words = max(len(section.split()) for section in sections)
        if words > 450:
            long[page.name] = words
    assert not long, f"split these pages' longest sections with headings: {long}"
