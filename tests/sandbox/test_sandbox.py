"""The sandbox every agent command and verifier runs in: the escape battery, limits, layout, and backend selection.

Each escape must be contained (the host is unchanged, the machine responsive, nothing left running) and reported
(in the ``CommandResult``); after each, a fresh attempt still runs ``echo ok``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tracemalloc
import uuid

import pytest

from tslightning.sandbox import (
    AttemptDirectory,
    BubblewrapSandbox,
    DockerSandbox,
    SandboxError,
    SandboxLimits,
    SandboxUnavailableError,
    SubprocessSandbox,
    bubblewrap,
    make_sandbox,
)
from tslightning.sandbox.output import BoundedOutput
from tslightning.sandbox.supervision import CommandRequest, classify_limit

QUICK = SandboxLimits(timeout_s=20)


@pytest.fixture
def attempt():
    with AttemptDirectory() as directory:
        yield directory


@pytest.fixture
def sandbox(attempt):
    return BubblewrapSandbox(attempt, limits=QUICK)


def _marker() -> str:
    return f"tslmark{uuid.uuid4().hex[:12]}"


def _running(marker: str) -> list[str]:
    """Host processes whose command line contains ``marker`` (the sandbox's and its launcher's included)."""
    found = subprocess.run(["pgrep", "-f", "-a", marker], capture_output=True, text=True)
    return found.stdout.splitlines()


class TestEscapeBattery:
    @pytest.fixture(autouse=True)
    def _fresh_attempt_still_works(self):
        yield
        with AttemptDirectory() as fresh:
            result = BubblewrapSandbox(fresh).run("echo ok", limits=SandboxLimits(timeout_s=10))
        assert result.ok and result.output == "ok\n" and result.limit_hit is None

    def test_writes_outside_the_work_dir_fail_and_leave_the_host_unchanged(self, sandbox):
        name = f"tsl-evil-{uuid.uuid4().hex[:8]}"
        targets = [f"/etc/{name}", f"/usr/{name}", f"/root/{name}", f"/{name}", f"/dev/{name}"]
        try:
            for target in targets[:2]:
                result = sandbox.run(f"echo x > {target}")
                assert result.exit_code == 1 and "Read-only file system" in result.output, result
            for target in targets[2:]:
                result = sandbox.run(f"touch {target}")
                assert result.exit_code == 1 and "cannot touch" in result.output, result
            result = sandbox.run("echo 1 > /proc/sys/kernel/hostname")
            assert result.exit_code == 1
            for target in targets:
                assert not os.path.exists(target), f"{target} was created on the host"
        finally:
            for target in targets:
                if os.path.isfile(target):
                    os.unlink(target)

    def test_only_the_sandboxs_own_processes_are_visible(self, sandbox):
        result = sandbox.run("ls /proc | grep -c '^[0-9]'; cat /etc/shadow")
        assert int(result.output.split()[0]) <= 5  # bwrap's pid 1, the shell, ls, grep
        assert "Permission denied" in result.output  # root inside is an unprivileged uid outside

    def test_no_network_even_to_a_port_listening_on_the_host(self, sandbox):
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.setblocking(False)
            port = server.getsockname()[1]
            for target in [("127.0.0.1", port), ("127.0.0.1", 22)]:
                result = sandbox.run(f'python3 -c "import socket; socket.create_connection({target!r}, 2)"')
                assert result.exit_code == 1 and "ConnectionRefusedError" in result.output, result
            with pytest.raises(BlockingIOError):
                server.accept()  # nothing reached the host's listener
        result = sandbox.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80), 2)\"")
        assert result.exit_code == 1 and "Network is unreachable" in result.output

    def test_fork_bomb_is_contained_and_reported(self, sandbox):
        marker = _marker()
        result = sandbox.run(f":(){{ :|:& }};:; sleep 30 # {marker}", limits=SandboxLimits(timeout_s=3))
        assert result.timed_out and result.exit_code is None and result.signal == "SIGKILL"
        assert result.limit_hit == "processes"
        assert "fork: retry: Resource temporarily unavailable" in result.output
        assert result.duration_s < 3 + 5  # the whole namespace died with its pid 1
        assert _running(marker) == []

    def test_process_limit_is_per_sandbox_and_exact(self, sandbox):
        program = (
            "import os, time\n"
            "n = 0\n"
            "try:\n"
            "    for n in range(1, 200):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(30)\n"
            "            os._exit(0)\n"
            "except BlockingIOError:\n"
            "    print('fork refused at child', n)\n"
        )
        (sandbox.attempt.app / "forks.py").write_text(program)
        result = sandbox.run("python3 forks.py", limits=SandboxLimits(timeout_s=10, max_processes=32))
        assert result.exit_code == 0, result
        # 32 tasks in all: bwrap's pid 1, the shell exec'd into python, and the children that fit.
        assert result.output.startswith("fork refused at child"), result.output
        assert 25 <= int(result.output.split()[-1]) <= 32

    def test_ten_gigabytes_fail_to_allocate(self, sandbox):
        result = sandbox.run('python3 -c "b = bytearray(10*2**30)"')
        assert result.exit_code == 1 and "MemoryError" in result.output
        assert result.limit_hit == "memory"

    def test_sleep_forever_is_killed_at_the_timeout_with_nothing_left(self, sandbox):
        marker = _marker()
        result = sandbox.run(
            f"(exec -a {marker}-bg sleep 100000) & exec -a {marker} sleep 100000", limits=SandboxLimits(timeout_s=2)
        )
        assert result.timed_out and result.limit_hit == "timeout"
        assert result.exit_code is None and result.signal == "SIGKILL"
        assert 2 <= result.duration_s < 5
        assert _running(marker) == []

    def test_a_gigabyte_of_output_is_bounded_in_memory_and_time(self, sandbox):
        bound = sandbox.limits.max_output_bytes
        tracemalloc.start()
        try:
            result = sandbox.run("head -c 1000000000 /dev/zero | tr '\\0' a")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 8 * 2**20, f"parent held {peak} bytes"
        assert result.output_truncated and result.limit_hit == "output"
        assert result.exit_code is None and result.signal == "SIGKILL"  # killed past OUTPUT_KILL_FACTOR × bound
        head, marker, tail = result.output.partition(" bytes of output truncated ...]\n")
        assert marker and head.startswith("a" * (bound // 2)) and tail == "a" * (bound // 2)
        assert len(result.output) <= bound + 100

    def test_truncation_keeps_the_head_and_the_tail(self, sandbox):
        result = sandbox.run("echo START; head -c 3000000 /dev/zero | tr '\\0' b; echo; echo END")
        assert result.exit_code == 0 and result.output_truncated and result.limit_hit == "output"
        assert result.output.startswith("START\nbbb") and result.output.endswith("bbb\nEND\n")
        assert len(result.output.encode()) <= sandbox.limits.max_output_bytes + 100

    def test_a_file_bigger_than_the_limit_is_cut_and_reported(self, sandbox):
        limits = SandboxLimits(timeout_s=20, file_size_bytes=2**20)
        result = sandbox.run("head -c 3M /dev/zero > /app/big", limits=limits)
        assert result.limit_hit == "file_size" and result.signal == "SIGXFSZ" and result.exit_code == 128 + 25
        assert (sandbox.attempt.app / "big").stat().st_size == 2**20
        result = sandbox.run("python3 -c \"open('/app/big2', 'wb').write(bytes(3 * 2**20))\"", limits=limits)
        assert result.limit_hit == "file_size" and "File too large" in result.output

    def test_cpu_time_is_limited_and_reported(self, sandbox):
        result = sandbox.run("python3 -c 'while True: pass'", limits=SandboxLimits(timeout_s=20, cpu_seconds=1))
        assert result.signal == "SIGXCPU" and result.limit_hit == "cpu" and not result.timed_out

    def test_host_environment_is_not_visible(self, sandbox, monkeypatch):
        monkeypatch.setenv("SECRET_TOKEN", "hunter2-do-not-leak")
        result = sandbox.run("env; cat /proc/*/environ", env={"TASK_HINT": "explicit"})
        assert "SECRET_TOKEN" not in result.output and "hunter2" not in result.output
        names = {line.split("=", 1)[0] for line in result.output.splitlines() if "=" in line}
        assert {"PATH", "HOME", "LANG", "TERM", "TASK_HINT"} <= names <= {
            "PATH", "HOME", "LANG", "TERM", "TASK_HINT", "PWD", "SHLVL", "_",
        }  # fmt: skip
        assert "TASK_HINT=explicit" in result.output and "HOME=/tmp" in result.output

    def test_background_jobs_end_with_their_command(self, sandbox):
        marker = _marker()
        result = sandbox.run(f"(exec -a {marker} sleep 1000) & echo started")
        assert result.ok and result.output == "started\n" and result.duration_s < 5
        assert _running(marker) == []


class TestAttemptLayout:
    def test_app_is_writable_and_persists_between_runs(self, sandbox):
        assert sandbox.run("echo persisted > /app/state.txt").ok
        assert sandbox.run("cat state.txt").output == "persisted\n"
        assert (sandbox.attempt.app / "state.txt").read_text() == "persisted\n"

    def test_tmp_is_private_to_each_run(self, sandbox):
        assert sandbox.run("echo x > /tmp/scratch").ok
        assert sandbox.run("test -e /tmp/scratch").exit_code == 1

    def test_tests_and_oracle_are_only_visible_when_requested(self, sandbox):
        (sandbox.attempt.tests / "test_outputs.py").write_text("def test_ok(): pass\n")
        (sandbox.attempt.oracle / "solve.sh").write_text("echo solved\n")
        for mount, point, name in [("tests", "/tests", "test_outputs.py"), ("oracle", "/oracle", "solve.sh")]:
            hidden = sandbox.run(f"ls {point}")
            assert hidden.exit_code != 0 and "No such file or directory" in hidden.output
            shown = sandbox.run(f"ls {point}", mounts=("app", mount))
            assert shown.ok and shown.output == f"{name}\n"

    def test_verifier_writes_its_reward_to_the_host(self, sandbox):
        (sandbox.attempt.tests / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
        result = sandbox.run("bash /tests/test.sh", mounts=("app", "tests", "logs"), cwd="/tests")
        assert result.ok, result
        assert (sandbox.attempt.logs / "reward.txt").read_text() == "1\n"

    @pytest.mark.skipif(os.geteuid() != 0, reason="hand-over to another uid needs a root trainer")
    @pytest.mark.parametrize("live", [False, True], ids=["per-command", "live"])
    def test_the_ownership_walk_runs_again_only_after_the_trainer_wrote(self, attempt, monkeypatch, live):
        """The agent's commands create files as the sandbox's uid: between them, walking ``/app`` to hand it over
        finds nothing, so it is skipped until the trainer writes (and says so); then the agent may change what the
        trainer wrote."""
        walks = []
        real = bubblewrap.chown_tree
        monkeypatch.setattr(bubblewrap, "chown_tree", lambda root, uid, gid: (walks.append(root), real(root, uid, gid)))
        sandbox = make_sandbox("bubblewrap", attempt=attempt, limits=QUICK, live=live)
        try:
            assert sandbox.run("mkdir -p made && echo 1 > made/file").ok
            once = [attempt.app, attempt.oracle] if live else [attempt.app]  # a live environment shows both
            assert walks == once
            assert sandbox.run("echo 2 >> made/file && ls -A").output == "made\n"
            assert walks == once
            (attempt.app / "given.txt").write_text("from the trainer\n")
            attempt.wrote_from_host()
            changed = sandbox.run("echo by the agent >> given.txt && cat given.txt")
            assert changed.ok and changed.output == "from the trainer\nby the agent\n", changed
            assert walks == once * 2
            assert sandbox.run("true").ok and walks == once * 2
            if not live:  # other mounts are another hand-over, and so is going back
                assert sandbox.run("ls /oracle", mounts=("app", "oracle")).ok and sandbox.run("true").ok
                assert walks == [*once * 2, attempt.app, attempt.oracle, attempt.app]
        finally:
            sandbox.close()

    def test_a_new_attempt_starts_from_the_task_environment(self, tmp_path):
        (tmp_path / "data.csv").write_text("a,b\n")
        with AttemptDirectory(tmp_path) as first:
            first_root = first.root
            assert BubblewrapSandbox(first).run("echo dirty > leftover; ls").output == "data.csv\nleftover\n"
        assert not first_root.exists()
        with AttemptDirectory(tmp_path) as second:
            assert BubblewrapSandbox(second).run("ls -A /app").output == "data.csv\n"
        assert (tmp_path / "data.csv").read_text() == "a,b\n" and not (tmp_path / "leftover").exists()

    def test_close_removes_everything_even_unwritable_dirs(self):
        attempt = AttemptDirectory()
        root = attempt.root
        assert BubblewrapSandbox(attempt).run("mkdir -p locked/inner && touch locked/inner/f && chmod 000 locked").ok
        attempt.close()
        attempt.close()  # idempotent
        assert not root.exists()
        with pytest.raises(RuntimeError, match="closed"):
            BubblewrapSandbox(attempt).run("true")

    def test_missing_environment_dir_is_named(self, tmp_path):
        with pytest.raises(FileNotFoundError, match="no-such-env"):
            AttemptDirectory(tmp_path / "no-such-env")

    def test_a_sandbox_that_cannot_start_raises(self, sandbox):
        with pytest.raises(SandboxError, match="could not start"):
            sandbox.run("true", cwd="/no/such/dir")
        with pytest.raises(ValueError, match="unknown mounts"):
            sandbox.run("true", mounts=("app", "home"))


class TestBackendSelection:
    def test_make_sandbox_names_the_fix_when_bwrap_is_missing(self, attempt, monkeypatch):
        real_which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda cmd, *a, **k: None if cmd == "bwrap" else real_which(cmd, *a, **k))
        with pytest.raises(SandboxUnavailableError, match=r"sandbox\.backend='bubblewrap'.*apt-get install bubblewrap"):
            make_sandbox(attempt=attempt)

    def test_make_sandbox_rejects_unknown_backends(self, attempt):
        with pytest.raises(ValueError, match=r"sandbox\.backend must be one of"):
            make_sandbox("firejail", attempt=attempt)  # type: ignore[arg-type]

    def test_make_sandbox_defaults_to_bubblewrap(self, attempt):
        assert isinstance(make_sandbox(attempt=attempt), BubblewrapSandbox)

    def test_docker_refuses_without_a_cli(self, attempt, monkeypatch):
        monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
        with pytest.raises(SandboxUnavailableError, match=r"sandbox\.backend='docker'.*not on PATH"):
            make_sandbox("docker", attempt=attempt)

    def test_docker_refuses_without_an_engine(self, attempt):
        docker = shutil.which("docker")
        if docker is None:
            pytest.skip("no docker CLI here (covered by test_docker_refuses_without_a_cli)")
        if subprocess.run([docker, "info"], capture_output=True, timeout=30).returncode == 0:
            pytest.skip("a Docker engine answers here")
        with pytest.raises(SandboxUnavailableError, match=r"needs a running Docker engine.*docker info"):
            DockerSandbox(attempt)

    def test_docker_runs_each_command_in_an_offline_limited_container(self, attempt, tmp_path, monkeypatch):
        fake = tmp_path / "bin" / "docker"
        fake.parent.mkdir()
        fake.write_text('#!/bin/sh\n[ "$1" = info ] && echo 27.0.0\n')  # an engine that answers `docker info`
        fake.chmod(0o755)
        monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
        sandbox = DockerSandbox(attempt, image="task-image:1")
        launch = sandbox._launch(CommandRequest("echo hi", SandboxLimits(), ("app", "logs"), "/app", {"K": "v"}, 9))
        argv = " ".join(launch.argv)
        for flag in ["run --rm", "--network none", f"--memory {2 * 2**30}", "--pids-limit 256", "--read-only"]:
            assert flag in argv
        assert f"source={attempt.app},target=/app" in argv and f"source={attempt.logs},target=/logs/verifier" in argv
        assert launch.argv[-6:-3] == ["task-image:1", "/bin/bash", "-c"] and launch.argv[-1] == "echo hi"
        assert "--env K" in argv and "v" not in launch.argv and launch.env["K"] == "v"

    def test_subprocess_backend_warns_that_it_does_not_isolate(self, attempt, monkeypatch):
        monkeypatch.setenv("SECRET_TOKEN", "hunter2")
        with pytest.warns(UserWarning, match="does NOT isolate"):
            unisolated = make_sandbox("subprocess", attempt=attempt, limits=QUICK)
        assert isinstance(unisolated, SubprocessSandbox)
        result = unisolated.run("pwd; echo token=$SECRET_TOKEN")
        assert result.output == f"{attempt.app}\ntoken=\n"
        assert unisolated.run("sleep 100", limits=SandboxLimits(timeout_s=1)).timed_out


class TestLimitsAndReporting:
    def test_invalid_limits_name_every_field(self):
        with pytest.raises(ValueError) as err:
            SandboxLimits(timeout_s=0, memory_bytes=1, max_processes=True)  # type: ignore[arg-type]
        message = str(err.value)
        assert "sandbox.limits.timeout_s" in message and "sandbox.limits.memory_bytes" in message
        assert "sandbox.limits.max_processes" in message

    def test_bounded_output_keeps_head_and_tail(self):
        output = BoundedOutput(10)
        for chunk in [b"01234", b"56789", b"abcdefghij" * 5, b"XYZ"]:
            output.append(chunk)
        assert output.truncated and output.total_bytes == 63
        assert output.text() == "01234\n[... 53 bytes of output truncated ...]\nijXYZ"
        small = BoundedOutput(10)
        small.append("é".encode()[:1] + b"ok")
        assert not small.truncated and small.text() == "\ufffdok"

    def test_kernel_evidence_explains_more_than_the_timeout(self):
        assert classify_limit("fork: retry: Resource temporarily unavailable", "SIGKILL", "timeout", False) == (
            "processes"
        )
        assert classify_limit("", "SIGXFSZ", None, False) == "file_size"
        assert classify_limit("", "SIGKILL", "timeout", True) == "timeout"
        assert classify_limit("", None, None, True) == "output"
        assert classify_limit("all fine", None, None, False) is None
