"""A compose task's helper services, without a container engine: each in its image-lite root, in the attempt's own
network, started in ``depends_on`` order, healthy before the agent's first command, and torn down with the attempt.

Each helper service (an API server, an MCP server, a database beside Harbor's ``main``) runs as a live environment
of its own (:class:`~tslightning.sandbox.live_environment.LiveBubblewrapSandbox`): its image's root read-only with
private writable copies (:func:`~tslightning.tasks.environment.image_attempt.enter_root`), its own mount, PID, IPC and
UTS namespaces and its own host uid (:data:`HELPER_UID`), under the task's limits (memory, disk, processes, ``/tmp``);
its start-up command is the image's ``ENTRYPOINT`` / ``CMD`` as the compose file overrides them, in its
``working_dir``, with the image's ``ENV`` and the file's ``environment``. What it shares with ``main`` and the
verifier is the network (:class:`~tslightning.sandbox.attempt_network.AttemptNetwork`): one namespace for the whole
attempt, where every service name (and alias) is ``127.0.0.1`` in each service's private ``/etc/hosts`` (services
in one namespace reach one another on loopback; unlike Docker's per-container addresses, two services cannot listen
on the same port, and a service listening on ``127.0.0.1`` only is reachable too). Named volumes and binds of task
files are per-attempt directories.

``depends_on`` is honoured as ``docker compose up --wait`` honours it (Harbor's start): a service starts after its
dependencies have started, become healthy (``service_healthy``: its ``healthcheck`` probed inside it, a probe of
``timeout`` seconds every ``interval``, ``retries`` failures after ``start_period`` making it unhealthy), or exited 0
(``service_completed_successfully``: it runs to completion first); every service with a healthcheck is healthy
before ``main`` starts. Probes during the start period come sooner than Docker's (they cannot fail the service), so
a service counts as healthy as soon as it answers. An unhealthy service fails the attempt's start with its probe's
output and the tail of its start-up log (``/tmp/startup.log`` inside it).

Closing the services ends each environment (the kernel kills every process in its PID namespace, so nothing a
helper started outlives it), removes its directories and lets go of the network.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from tslightning.sandbox import AttemptDirectory, LiveBubblewrapSandbox, SandboxLimits
from tslightning.sandbox.attempt_network import AttemptNetwork
from tslightning.sandbox.attempt_parent import attempt_parent
from tslightning.sandbox.bubblewrap import DEFAULT_UNPRIVILEGED_UID
from tslightning.sandbox.errors import SandboxError
from tslightning.sandbox.file_tree import remove_tree
from tslightning.sandbox.tree_copy import copy_tree
from tslightning.tasks.environment.image_attempt import enter_root
from tslightning.tasks.environment.image_lite import ImageLite, build_image
from tslightning.tasks.environment.offline_toolchain import Toolchain, attach, service_env
from tslightning.tasks.harbor.compose_project import ComposeProject, ServiceSpec
from tslightning.tasks.harbor.dockerfile import Dockerfile
from tslightning.tasks.terminal_task import TerminalTask

HELPER_UID = DEFAULT_UNPRIVILEGED_UID + 2
"""Host uid (and gid) of helper services (the agent's is 61000, the verifier's 61001)."""
LOOPBACK = "127.0.0.1"
FIRST_PROBE_S = 0.1
"""Delay before the first health probe; it doubles up to the start interval while the start period lasts."""
LOG_TAIL_BYTES = 1500


def helper_image(task: TerminalTask, service: ServiceSpec, cache_dir: Path | None = None) -> ImageLite:
    """The image of a helper ``service`` of ``task``: its ``build``'s Dockerfile, or ``FROM`` its ``image``, built
    (or found in the cache by content) as the task's own image is.

    Raises:
        ImageBuildError: the build failed or cannot run here.
    """
    timeout = task.environment.build_timeout_sec
    if service.dockerfile is not None:
        return build_image(service.dockerfile, cache_dir, timeout_s=timeout)
    with tempfile.TemporaryDirectory(prefix="tsl-compose-image-") as context:
        dockerfile = Path(context) / "Dockerfile"
        dockerfile.write_text(f"FROM {service.image}\n")
        return build_image(dockerfile, cache_dir, timeout_s=timeout)


def helper_images(task: TerminalTask, cache_dir: Path | None = None) -> dict[str, ImageLite]:
    """Every helper service's image, by service name (none for a task without helpers)."""
    return {service.name: helper_image(task, service, cache_dir) for service in task.needs.helpers}


def image_start(service: ServiceSpec) -> tuple[tuple[str, ...] | str | None, tuple[str, ...] | str | None]:
    """The image's ``ENTRYPOINT`` and ``CMD`` (exec form as a tuple, shell form as a string, ``None`` unset)."""
    if service.dockerfile is None:
        return None, None
    dockerfile = Dockerfile.read(service.dockerfile)
    found = []
    for keyword in ("ENTRYPOINT", "CMD"):
        instructions = dockerfile.of(keyword)
        last = instructions[-1] if instructions else None
        found.append(None if last is None else last.exec_form if last.exec_form is not None else last.arguments)
    return found[0], found[1]


class HelperServices:
    """The helper services of one attempt at ``task`` (see the module docstring); :meth:`close` when done.

    Args:
        task: The task (its compose file's helpers, its limits).
        limits: The limits of every service's environment (memory, disk, processes, ``/tmp``; its start-up command
            gets ``cpu_seconds``).
        images: Each helper's image by name (default: built or found in the cache now).
        toolchain: The offline toolchain shown to each helper (a ``uv run`` start-up resolves from its wheels).

    Raises:
        SandboxUnavailableError: the trainer is not root (the attempt's network needs it) or bwrap is missing.
        ImageBuildError: a helper's image could not be built.
    """

    def __init__(
        self,
        task: TerminalTask,
        limits: SandboxLimits,
        images: Mapping[str, ImageLite] | None = None,
        toolchain: Toolchain | None = None,
    ) -> None:
        project = task.needs.compose
        if project is None:
            raise ValueError(f"task {task.name!r} has no compose file")
        self.task, self.limits, self.toolchain = task, limits, toolchain
        self.project: ComposeProject = project
        self.images = dict(images) if images is not None else helper_images(task)
        self.network = AttemptNetwork(HELPER_UID)
        self.sandboxes: dict[str, LiveBubblewrapSandbox] = {}
        self.attempts: dict[str, AttemptDirectory] = {}
        self.started_at: dict[str, float] = {}
        self.startup_s: dict[str, float] = {}
        """Seconds from each service's start until it was healthy (or started, without a healthcheck)."""
        self._healthy: set[str] = set()
        self._volumes = Path(tempfile.mkdtemp(prefix="tsl-volumes-", dir=attempt_parent()))
        self._volumes.chmod(0o755)

    @property
    def hosts(self) -> list[tuple[str, str]]:
        """``(name, address)`` lines every service's ``/etc/hosts`` gets: each name on loopback, ``extra_hosts``."""
        lines = [(name, LOOPBACK) for name in self.project.host_names()]
        return lines + [pair for service in self.project.services.values() for pair in service.extra_hosts]

    def volumes_of(self, service: ServiceSpec) -> dict[str, Path]:
        """Path inside → this attempt's host directory of each of ``service``'s volumes (made on first use)."""
        found = {}
        for volume in service.volumes:
            key = str(volume.source) if volume.named else f"bind-{abs(hash(volume.source)):x}"
            host = self._volumes / key.replace("/", "_")
            if not host.exists():
                if volume.named:
                    host.mkdir()
                elif Path(volume.source).is_dir():
                    copy_tree(volume.source, host)
                else:
                    raise SandboxError(f"service {service.name!r}: volume {volume.source} is not a directory")
                host.chmod(0o1777)  # services run as different uids: each may write what it creates
            found[volume.target] = host
        return found

    def start(self) -> dict[str, float]:
        """Start every helper in ``depends_on`` order and wait until each with a healthcheck is healthy (and what
        ``main`` depends on is as it asks); returns :attr:`startup_s`.

        Raises:
            SandboxError: a service did not start, exited non-zero where it must complete, or is unhealthy.
        """
        one_shots = {
            name
            for service in self.project.services.values()
            for name, condition in service.depends_on.items()
            if condition == "service_completed_successfully"
        }
        for service in self.project.helpers:
            self._await(service)
            self._start(service, one_shot=service.name in one_shots)
        self._await(self.project.main)
        for service in self.project.helpers:
            if service.healthcheck is not None:
                self._wait_healthy(service)
        return self.startup_s

    def _await(self, service: ServiceSpec) -> None:
        for name, condition in service.depends_on.items():
            if condition == "service_healthy":
                dependency = self.project.services[name]
                if dependency.healthcheck is None:
                    raise SandboxError(
                        f"service {service.name!r} waits for {name!r} to be healthy, and {name!r} has no healthcheck"
                    )
                self._wait_healthy(dependency)

    def _start(self, service: ServiceSpec, one_shot: bool) -> None:
        sandbox = self._sandbox(service)
        workdir = service.working_dir or self.images[service.name].workdir
        env = self._env(service, sandbox)
        command = service.start_command(*image_start(service))
        self.started_at[service.name] = time.monotonic()
        if one_shot:
            done = sandbox.run(command, limits=self.limits, cwd=workdir, env=env)
            if not done.ok:
                raise SandboxError(
                    f"service {service.name!r} must complete successfully, and exited {done.exit_code}: "
                    f"{done.output[-LOG_TAIL_BYTES:].strip()}"
                )
        else:
            sandbox.startup = (command, workdir, env) if command.strip() else None
            sandbox.start(self.limits)
        self.startup_s[service.name] = time.monotonic() - self.started_at[service.name]

    def _sandbox(self, service: ServiceSpec) -> LiveBubblewrapSandbox:
        """The service's own attempt directory and sandbox in its image's root and the attempt's network."""
        attempt = AttemptDirectory(hidden=(self.task.root,))
        self.attempts[service.name] = attempt
        sandbox = LiveBubblewrapSandbox(
            attempt, limits=self.limits, unprivileged_uid=HELPER_UID, verifier_uid=HELPER_UID + 1
        )
        self.sandboxes[service.name] = sandbox
        sandbox.network = self.network
        image = self.images[service.name]
        workdir = service.working_dir or image.workdir
        enter_root(image, attempt, sandbox, workdir, service.name, self.hosts, self.volumes_of(service))
        if self.toolchain is not None:
            attach(sandbox, self.toolchain)
        return sandbox

    def _env(self, service: ServiceSpec, sandbox: LiveBubblewrapSandbox) -> dict[str, str]:
        return service_env(sandbox, {**self.images[service.name].env, **service.environment})

    def _wait_healthy(self, service: ServiceSpec) -> None:
        """Probe ``service``'s healthcheck inside it until it passes (see the module docstring)."""
        if service.name in self._healthy:
            return
        check, sandbox = service.healthcheck, self.sandboxes[service.name]
        workdir = service.working_dir or self.images[service.name].workdir
        probe_limits = replace(self.limits, timeout_s=check.timeout_s)
        env, started = self._env(service, sandbox), self.started_at[service.name]
        failures, delay = 0, FIRST_PROBE_S
        while True:
            probe = sandbox.run(check.command, limits=probe_limits, cwd=workdir, env=env)
            if probe.ok:
                self._healthy.add(service.name)
                self.startup_s[service.name] = time.monotonic() - started
                return
            starting = time.monotonic() - started < check.start_period_s
            failures += 0 if starting else 1
            if failures >= check.retries:
                raise SandboxError(self._unhealthy(service, failures, probe.output))
            delay = min(delay * 2, check.start_interval_s) if starting else check.interval_s
            time.sleep(delay)

    def _unhealthy(self, service: ServiceSpec, failures: int, output: str) -> str:
        log = self.sandboxes[service.name].run(f"tail -c {LOG_TAIL_BYTES} /tmp/startup.log 2>/dev/null", cwd="/")
        return (
            f"helper service {service.name!r} is unhealthy: its healthcheck failed {failures} times after its "
            f"start period ({output.strip()[-LOG_TAIL_BYTES:] or 'no output'}); its start-up log: "
            f"{log.output.strip() or '(empty)'}"
        )

    def close(self) -> None:
        """End every service (nothing it started survives), remove their directories and volumes, and let go of the
        network; idempotent."""
        try:
            for sandbox in self.sandboxes.values():
                sandbox.close()
            for attempt in self.attempts.values():
                attempt.close()
        finally:
            self.sandboxes.clear()
            self.attempts.clear()
            self.network.close()
            if self._volumes.exists():
                remove_tree(self._volumes)


__all__ = ["HELPER_UID", "HelperServices", "helper_image", "helper_images", "image_start"]
