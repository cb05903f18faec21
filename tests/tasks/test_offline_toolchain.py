"""The Terminal-Bench 2 verifier template runs offline from the local wheel cache, without editing the task.

The wheel cache is filled once per machine from PyPI (the only download, cached under the system temp directory
across sessions); the test is skipped, saying why, where PyPI cannot be reached.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tslightning.sandbox import AttemptDirectory, BubblewrapSandbox, SandboxLimits
from tslightning.tasks.environment.offline_toolchain import (
    TOOLCHAIN_BIN,
    attach,
    fetches_toolchain,
    fill_wheel_cache,
    find_toolchain,
    prepare_toolchain,
    requirements_of,
    toolchain_env,
)
from tslightning.tasks.harbor.migration import migrate_tasks
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import unmet_needs, validate_task

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_tasks"
TB2 = FIXTURES / "tb2-uvx-template"
TB1 = Path(__file__).resolve().parents[1] / "fixtures" / "terminal_bench_1" / "word-count"
CACHE = Path(tempfile.gettempdir()) / "tslightning-test-cache"


@pytest.fixture(scope="session")
def toolchain_cache() -> Path:
    """A prepared toolchain whose wheel cache holds the fixtures' pins (filled from PyPI once, then reused)."""
    toolchain = prepare_toolchain(CACHE)
    try:
        fill_wheel_cache(toolchain, requirements_of([TB2]), timeout_s=300)
    except (RuntimeError, OSError) as error:
        pytest.skip(f"the wheel cache cannot be filled from PyPI here: {str(error)[-300:]}")
    return CACHE


def test_the_template_pins_are_found():
    assert requirements_of([TB2]) == ["pytest-json-ctrf==0.3.5", "pytest==8.4.1"]
    assert fetches_toolchain(TB2 / "tests" / "test.sh") == "astral.sh/uv/0.9.5/install.sh"
    assert fetches_toolchain(FIXTURES / "named-rewards" / "tests" / "test.sh") is None


def test_without_the_toolchain_the_task_needs_the_network(tmp_path, monkeypatch):
    monkeypatch.setenv("TSLIGHTNING_CACHE_DIR", str(tmp_path))
    assert find_toolchain() is None
    status, (reason,) = unmet_needs(TerminalTask.load(TB2))
    assert status == "needs network at build" and "tslightning tasks toolchain" in reason
    assert "astral.sh/uv/0.9.5/install.sh" in reason
    result = validate_task(TB2)
    assert result.status == "needs network at build" and result.reference is None  # never "scored 0"


def test_the_unedited_template_validates_offline(toolchain_cache, monkeypatch):
    monkeypatch.setenv("TSLIGHTNING_CACHE_DIR", str(toolchain_cache))
    result = validate_task(TB2)
    assert result.status == "valid", result.problems
    output = result.reference.output
    assert "2 passed" in output and "pytest-8.4.1" in output and "plugins: json-ctrf-0.3.5" in output
    assert "2 failed" in result.noop.output


def test_a_migrated_terminal_bench_1_task_validates_offline(toolchain_cache, tmp_path, monkeypatch):
    migrate_tasks(TB1, tmp_path / "migrated")
    migrated = tmp_path / "migrated" / TB1.name
    assert fetches_toolchain(migrated / "tests") == "astral.sh/uv/0.7.13/install.sh"  # in the harness's helper
    assert requirements_of([migrated]) == ["pytest-json-ctrf==0.3.5", "pytest==8.4.1"]
    monkeypatch.setenv("TSLIGHTNING_CACHE_DIR", str(tmp_path / "empty"))
    assert validate_task(migrated).status == "needs network at build"
    monkeypatch.setenv("TSLIGHTNING_CACHE_DIR", str(toolchain_cache))
    result = validate_task(migrated)
    assert result.status == "valid", result.problems
    assert result.reference.reading.tests_passed == result.reference.reading.tests_total == 3


def test_the_shims(toolchain_cache):
    with AttemptDirectory() as attempt:
        sandbox = BubblewrapSandbox(attempt, limits=SandboxLimits(timeout_s=60))
        attach(sandbox, find_toolchain(toolchain_cache))
        env = toolchain_env(sandbox, {})
        assert env["PATH"].startswith(TOOLCHAIN_BIN + ":")

        def run(command: str):
            return sandbox.run(command, env=env, mounts=("app",))

        installer = run("curl -fsSL https://astral.sh/uv/0.9.5/install.sh -o /tmp/i.sh && sh /tmp/i.sh")
        assert installer.exit_code == 0 and "everything's installed!" in installer.output
        assert run("apt-get update").exit_code == 0
        missing = run("apt-get install -y --no-install-recommends bash tsl-no-such-package")
        assert missing.exit_code == 100 and "not installed in this environment: tsl-no-such-package" in missing.output
        assert run("apt-get install -y bash").exit_code == 0
        # -p before the tool picks the Python; after it, it is the tool's own option (pytest's -p plugin flag).
        args = run(
            "sh /run/tslightning/tools/uv-install.sh >/dev/null && . $HOME/.local/bin/env && "
            "uvx -p 3.99 -w pytest==8.4.1 pytest -p no:cacheprovider --version"
        )
        assert "Python 3.99 is not installed here" in args.output and "pytest 8.4.1" in args.output, args.output
