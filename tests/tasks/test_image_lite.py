"""Image-lite: a task's Dockerfile built as a root filesystem (mmdebstrap + RUN in bubblewrap), and attempts in it.

Every build here goes through one cache under the system temp directory, shared by the session (and later sessions
on the same machine): the Debian base is built once from the package mirror (the only download), each image once.
Skipped, saying why, where the builder cannot run (not root, no mmdebstrap).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tslightning.tasks.environment.image_lite import (
    ImageBuildError,
    _host,
    base_for,
    build_image,
    builder_problem,
    image_key,
)
from tslightning.tasks.harbor.dockerfile import Dockerfile
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import validate_task

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_tasks"
SERVICE = FIXTURES / "service-build"
CACHE = Path(tempfile.gettempdir()) / "tslightning-test-cache"


@pytest.fixture(scope="session")
def image_cache() -> Path:
    """The shared build cache, with the service-build fixture's image in it."""
    problem = builder_problem()
    if problem is not None:
        pytest.skip(problem)
    build_image(SERVICE / "environment" / "Dockerfile", cache_dir=CACHE)
    return CACHE


@pytest.fixture
def cached(image_cache, monkeypatch) -> Path:
    monkeypatch.setenv("TSLIGHTNING_CACHE_DIR", str(image_cache))
    return image_cache


def test_bases_map_to_debian_roots():
    assert base_for("python:3.13-slim-bookworm").suite == "bookworm"
    assert base_for("python:3.13-slim").suite == "trixie" and "python-is-python3" in base_for("python:3.12").packages
    assert base_for("python:3.11").suite == "bookworm" and base_for("debian:12").suite == "bookworm"
    assert base_for("ubuntu:24.04").suite == "trixie" and "standing in" in base_for("ubuntu:24.04").note
    with pytest.raises(ValueError, match="needs image"):
        base_for("node:20")


def test_the_cache_key_follows_the_build_context(tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM debian:trixie\nCOPY a.txt /a.txt\n")
    (tmp_path / "a.txt").write_text("one\n")
    first = image_key(Dockerfile.read(tmp_path / "Dockerfile"), tmp_path)
    assert image_key(Dockerfile.read(tmp_path / "Dockerfile"), tmp_path) == first
    (tmp_path / "a.txt").write_text("two\n")
    assert image_key(Dockerfile.read(tmp_path / "Dockerfile"), tmp_path) != first


def test_the_service_task_validates_in_its_image(cached):
    result = validate_task(SERVICE)
    assert result.status == "valid", result.problems
    assert result.build_s is not None and result.reference.passed and result.noop.passed_fraction == 0.0


def test_an_attempt_runs_inside_the_image_with_its_service(cached):
    task = TerminalTask.load(SERVICE)
    with TerminalTaskAttempt(task) as attempt:
        assert attempt.image is not None and attempt.image.start_command == "python3 /opt/kv/kv_server.py"
        probe = attempt.run_command(
            "pwd; echo $KV_KEY; cat /etc/kv/kv.conf | head -1; command -v jq; "
            "grep -c ^VERSION_CODENAME=trixie /etc/os-release; "
            "for _ in $(seq 50); do curl -sf http://127.0.0.1:8765/answer && break; sleep 0.1; done"
        )
        assert probe.output.splitlines() == [
            "/srv/work", "answer", "port=8765", "/usr/bin/jq", "1", '{"value": 42, "unit": "none"}',
        ], probe.output  # fmt: skip
        attempt.run_command("sleep 300 & echo $! > started.pid")
        alive = attempt.run_command('kill -0 "$(cat started.pid)" && echo alive; touch /usr/bin/x 2>&1 | tail -1')
        assert alive.output.startswith("alive\n") and "Read-only file system" in alive.output
        assert not (attempt.image.rootfs / "srv" / "work" / "started.pid").exists()  # a private copy per attempt


def test_each_attempt_writes_its_own_etc_hosts_which_the_verifier_sees(cached, tmp_path):
    """As Docker's per-container /etc/hosts: an entrypoint routes a name to a local service; nothing else sees it."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test.sh").write_text(
        "#!/bin/bash\ngrep -q '^127.0.0.1 kv.internal$' /etc/hosts && echo 1 > /logs/verifier/reward.txt "
        "|| echo 0 > /logs/verifier/reward.txt\n"
    )
    (tests / "test.sh").chmod(0o755)
    task = TerminalTask.load(SERVICE)
    with TerminalTaskAttempt(task) as attempt:
        routed = attempt.run_command(
            "echo '127.0.0.1 kv.internal' >> /etc/hosts && "
            "for _ in $(seq 50); do curl -sf http://kv.internal:8765/answer && break; sleep 0.1; done"
        )
        assert '"value": 42' in routed.output, routed.output
        assert "kv.internal" not in (attempt.image.rootfs / "etc" / "hosts").read_text()
        attempt.verify(tests)
        assert attempt.verification.passed, attempt.verification.reason
    with TerminalTaskAttempt(task) as fresh:
        assert "kv.internal" not in fresh.run_command("cat /etc/hosts").output


def test_a_failing_build_names_its_line(cached, tmp_path):
    (tmp_path / "Dockerfile").write_text("FROM debian:trixie\nRUN echo building && false\n")
    with pytest.raises(ImageBuildError, match="Dockerfile:2: RUN exited 1: building"):
        build_image(tmp_path / "Dockerfile", cache_dir=cached)
    assert not list(cached.glob("images/.building-*"))  # nothing half-built is left or cached


def test_copies_never_follow_a_symlink_out_of_the_image(tmp_path):
    rootfs = tmp_path / "rootfs"
    (rootfs / "srv").mkdir(parents=True)
    (rootfs / "escape").symlink_to("/etc")  # an absolute link resolves on the host during the build
    (rootfs / "inside").symlink_to("srv")
    assert _host(rootfs, "/inside/a.txt") == rootfs / "inside" / "a.txt"
    with pytest.raises(ImageBuildError, match="leads outside the image"):
        _host(rootfs, "/escape/passwd")
