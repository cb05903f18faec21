"""The Dockerfile's ``USER`` in image-lite: resolved as Docker resolves it, and honoured in the build, the agent's
commands, the image's ``CMD`` and the ownership of the attempt's files (fixture ``image-user``)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tslightning.tasks.environment.image_lite import ImageBuildError, build_image, builder_problem
from tslightning.tasks.environment.image_user import carry_ownership, home_of, resolve_user
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import validate_task

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_tasks" / "image-user"
CACHE = Path(tempfile.gettempdir()) / "tslightning-test-cache"
PASSWD = "root:x:0:0:root:/root:/bin/bash\napp:x:1000:1000::/home/app:/bin/bash\nweb:x:33:33::/var/www:/bin/sh\n"
GROUP = "root:x:0:\nstaff:x:50:\napp:x:1000:\n"


@pytest.fixture
def rootfs(tmp_path) -> Path:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/passwd").write_text(PASSWD)
    (tmp_path / "etc/group").write_text(GROUP)
    return tmp_path


def test_users_resolve_as_docker_resolves_them(rootfs):
    assert resolve_user(rootfs, "app", 3) == (1000, 1000) and resolve_user(rootfs, "web:staff", 3) == (33, 50)
    assert resolve_user(rootfs, "1000:50", 3) == (1000, 50) and resolve_user(rootfs, "4242", 3) == (4242, 0)
    assert home_of(rootfs, 1000) == "/home/app" and home_of(rootfs, 4242) == "/"
    with pytest.raises(ValueError, match=r"Dockerfile:7: USER ghost: no user 'ghost' in the image's /etc/passwd"):
        resolve_user(rootfs, "ghost", 7)
    with pytest.raises(ValueError, match="no group 'wheel'"):
        resolve_user(rootfs, "app:wheel", 7)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files owners needs root")
def test_the_users_files_become_the_sandboxs_and_roots_stay_roots(tmp_path):
    source, copy = tmp_path / "source", tmp_path / "copy"
    for tree in (source, copy):
        (tree / "home").mkdir(parents=True)
        (tree / "home" / "mine").write_text("x")
        (tree / "policy").write_text("y")
    os.chown(source / "home", 1000, 1000)
    os.chown(source / "home" / "mine", 1000, 50)
    carry_ownership(source, copy, (1000, 1000), 61000)
    owners = {name: (os.stat(copy / name).st_uid, os.stat(copy / name).st_gid) for name in ("home", "home/mine")}
    assert owners == {"home": (61000, 61000), "home/mine": (61000, 0)}
    assert (os.stat(copy / "policy").st_uid, os.stat(copy).st_uid) == (0, 0)


@pytest.fixture(scope="module")
def image():
    problem = builder_problem()
    if problem is not None:
        pytest.skip(problem)
    return build_image(FIXTURE / "environment" / "Dockerfile", cache_dir=CACHE)


@pytest.fixture
def cached(image, monkeypatch):
    monkeypatch.setenv("TSLIGHTNING_CACHE_DIR", str(CACHE))
    return image


def test_the_build_runs_later_steps_as_the_user(cached):
    assert (cached.user, cached.uid, cached.gid) == ("app", 1000, 1000)
    built = cached.rootfs / "home/app/built.txt"
    assert built.read_text() == "built by app in /home/app\n" and built.stat().st_uid == 1000


def test_an_unknown_user_refuses_the_build_at_its_line(tmp_path):
    if builder_problem() is not None:
        pytest.skip(builder_problem())
    (tmp_path / "Dockerfile").write_text("FROM debian:trixie-slim\nUSER ghost\n")
    with pytest.raises(ImageBuildError, match="Dockerfile:2: USER ghost: no user 'ghost'"):
        build_image(tmp_path / "Dockerfile", cache_dir=CACHE)


def test_commands_and_cmd_run_as_the_user_with_the_images_owners(cached):
    with TerminalTaskAttempt(TerminalTask.load(FIXTURE), command_timeout_s=20) as attempt:
        probe = attempt.run_command(
            "id -un; id -u; id -g; pwd; echo $HOME; stat -c '%U %a' ~/notes.txt /app/policy.txt; "
            "echo x >> /app/policy.txt; echo more >> ~/notes.txt && echo appended; "
            "for _ in $(seq 50); do [ -s /tmp/cmd-user ] && break; sleep 0.1; done; cat /tmp/cmd-user"
        )
    assert probe.output.splitlines() == [
        "app", "1000", "1000", "/home/app", "/home/app", "app 644", "nobody 644",
        "/bin/bash: line 1: /app/policy.txt: Permission denied", "appended", "app",
    ], probe.output  # fmt: skip


def test_the_user_task_validates(cached):
    result = validate_task(FIXTURE)
    assert result.status == "valid", result.problems
    assert result.reference.passed and result.noop.passed_fraction == 0.0
