"""A backend for machines with a Docker engine: each command in a fresh ``docker run --rm`` container.

Compared with ``BubblewrapSandbox`` it bounds memory and processes for the whole command with cgroups
(``--memory``, ``--pids-limit``) and runs a task's own image, at the cost of a container start per command.
Docker's default seccomp profile refuses the kernel keyrings. Not enforced here: ``disk_bytes`` (only
``file_size_bytes`` per file and the ``/tmp`` tmpfs size), CPU affinity, and the verifier-run protections of
``BubblewrapSandbox`` (orphans killed, untraceable shell); ``/tests`` is mounted read-only.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import uuid

from tslightning.sandbox.attempt import MOUNT_POINTS, AttemptDirectory
from tslightning.sandbox.base import DEFAULT_PATH, Sandbox, limits_script
from tslightning.sandbox.errors import SandboxUnavailableError
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.supervision import CommandRequest, Launch

DEFAULT_IMAGE = "python:3.11-slim-bookworm"
_PROBE_TIMEOUT_S = 20.0


class DockerSandbox(Sandbox):
    """Runs each command in ``docker run --rm --network none`` with the attempt's directories bind-mounted.

    Args:
        attempt: the attempt whose directories the commands see.
        limits: the default limits of every ``run``.
        image: the image commands run in; it needs ``/bin/bash``.

    Raises:
        SandboxUnavailableError: the docker CLI is missing or no engine answers ``docker info``.
    """

    def __init__(
        self, attempt: AttemptDirectory, *, limits: SandboxLimits | None = None, image: str = DEFAULT_IMAGE
    ) -> None:
        super().__init__(attempt, limits=limits)
        self._docker = _engine_cli()
        self.image = image

    def _launch(self, request: CommandRequest) -> Launch:
        name = f"tsl-sandbox-{uuid.uuid4().hex[:16]}"
        limits = request.limits
        argv = [
            self._docker, "run", "--rm", "--name", name, "--init",
            "--network", "none", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            "--memory", str(limits.memory_bytes), "--memory-swap", str(limits.memory_bytes),
            "--pids-limit", str(limits.max_processes),
            "--read-only", "--tmpfs", f"/tmp:rw,size={limits.tmp_bytes}",
            "--workdir", request.cwd,
        ]  # fmt: skip
        for mount in request.mounts:
            readonly = ",readonly" if mount == "tests" else ""
            argv += [
                "--mount",
                f"type=bind,source={self.attempt.host_path(mount)},target={MOUNT_POINTS[mount]}{readonly}",
            ]
        for inside, host in sorted(self.shared.items()):
            argv += ["--mount", f"type=bind,source={host},target={inside},readonly"]
        for variable in request.env:
            argv += ["--env", variable]  # the value is taken from the client's environment, not its argv
        # The readiness descriptor does not cross into a container: setup failures show as docker's exit status 125.
        argv += [self.image, "/bin/bash", "-c", limits_script(limits, ready_fd=None), "tsl-sandbox", request.command]
        return Launch(
            argv=argv,
            env={**request.env, "PATH": DEFAULT_PATH},
            reports_readiness=False,
            stop_outside_group=lambda: self._kill_container(name),
        )

    def _kill_container(self, name: str) -> None:
        # Killing the client leaves the container running: kill it through the engine.
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run([self._docker, "kill", name], capture_output=True, timeout=_PROBE_TIMEOUT_S)


def _engine_cli() -> str:
    docker = shutil.which("docker")
    if docker is None:
        raise SandboxUnavailableError(
            "sandbox.backend='docker' needs the docker CLI and a running engine, and docker is not on PATH. "
            "Install Docker, or choose sandbox.backend='bubblewrap' (apt-get install bubblewrap)."
        )
    try:
        probe = subprocess.run(
            [docker, "info", "--format", "{{.ServerVersion}}"],
            capture_output=True,
            text=True,
            timeout=_PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise SandboxUnavailableError(f"sandbox.backend='docker': `docker info` did not answer: {err}") from err
    if probe.returncode != 0:
        detail = (probe.stderr or probe.stdout).strip().splitlines()
        raise SandboxUnavailableError(
            "sandbox.backend='docker' needs a running Docker engine, but `docker info` failed"
            f"{': ' + detail[-1] if detail else ''}. Start the engine (e.g. systemctl start docker) or choose "
            "sandbox.backend='bubblewrap' (apt-get install bubblewrap)."
        )
    return docker
