"""One attempt at a terminal task, as the agent loop sees it (``tslightning.rollout.agent_loop.TaskAttempt``).

The attempt owns a fresh attempt directory seeded from the task's ``environment/`` and its sandbox. The agent's
commands see only ``/app`` and run under the task's resources with Table 6's 120 s per command, in the task's working
directory and with its ``[environment] env``; :meth:`verify` then runs the task's verifier (which alone sees
``/tests``) and returns the reward, keeping the full verdict in :attr:`TerminalTaskAttempt.verification`.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Literal

from tslightning.sandbox import (
    AttemptDirectory,
    Backend,
    BubblewrapSandbox,
    CommandResult,
    ContainerSandbox,
    LiveBubblewrapSandbox,
    Sandbox,
    make_sandbox,
)
from tslightning.sandbox.errors import SandboxUnavailableError
from tslightning.sandbox.file_tree import place_tree
from tslightning.tasks.environment.container_image import prepare_container
from tslightning.tasks.environment.helper_services import HelperServices
from tslightning.tasks.environment.image_attempt import enter_image, image_for
from tslightning.tasks.environment.image_lite import ImageLite
from tslightning.tasks.environment.offline_toolchain import Toolchain, attach, find_toolchain
from tslightning.tasks.harbor.task_config import VerifierSettings
from tslightning.tasks.rewards import DEFAULT_REWARD_KEY, RewardScheme
from tslightning.tasks.terminal_task import AGENT_COMMAND_TIMEOUT_S, TerminalTask
from tslightning.tasks.verifier import REFERENCE_TIMEOUT_S, VerifierResult, run_reference_solution, run_verifier

SandboxFactory = Callable[[AttemptDirectory], Sandbox]
"""Makes the sandbox of one attempt (see :func:`sandbox_factory`)."""

APP = "/app"


def service_lifetime_s(task: TerminalTask) -> float:
    """How long a helper service may need to run: the attempt's agent time and its verifier's (its CPU seconds)."""
    agent = task.agent.timeout_sec if task.agent.timeout_sec is not None else REFERENCE_TIMEOUT_S
    return agent + task.verifier.timeout_sec


def sandbox_factory(backend: Backend = "bubblewrap") -> SandboxFactory:
    """A :data:`SandboxFactory` for a ``sandbox.backend`` name: one live environment per attempt where the backend
    has one (every agent command in the same sandbox; what it leaves running stays until the verifier is done)."""
    return lambda attempt: make_sandbox(backend, attempt=attempt, live=True)


class TerminalTaskAttempt:
    """A fresh environment for one trajectory on ``task``; close it (or use ``with``) to remove it.

    Args:
        task: The task to attempt.
        scheme: Reward scheme of the verifier's pass fraction (``seta`` partial or ``binary``).
        make_attempt_sandbox: Makes the attempt's sandbox (default: bubblewrap).
        command_timeout_s: Wall-clock limit of one agent command (Table 6: 120 s).
        reward_key: The named reward of ``reward.json`` read as the pass fraction (default ``reward``).
        toolchain: The offline verifier toolchain shown to the attempt's commands (``"auto"``: the prepared one in
            the cache directory, if any; :mod:`~tslightning.tasks.environment.offline_toolchain`); not shown by backends
            that cannot share a directory.
        image: The task's image-lite environment (``"auto"``: built, or found in the cache, when the task's
            environment needs a build; :mod:`~tslightning.tasks.environment.image_attempt`), or ``None`` for the host's
            system.
        allow_internet: The trainer lets tasks reach the internet: a task whose ``[environment]`` allows it
            (``allow_internet``, ``network_mode = "public"``) gets the host's network for its agent's commands and
            its verifier (bubblewrap). Default: every command offline, whatever the task says. A task with helper
            services stays in its own network, offline (:mod:`~tslightning.tasks.environment.helper_services`).
        service_images: Each helper service's image by name (default: built, or found in the cache, now).

    Raises:
        ImageBuildError: the task's image (or a helper's) could not be built.
        SandboxError: the environment or a helper service did not start (an unhealthy helper: its probe's output).
    """

    def __init__(
        self,
        task: TerminalTask,
        scheme: RewardScheme = "seta",
        make_attempt_sandbox: SandboxFactory | None = None,
        command_timeout_s: float = AGENT_COMMAND_TIMEOUT_S,
        reward_key: str = DEFAULT_REWARD_KEY,
        toolchain: Toolchain | Literal["auto"] | None = "auto",
        image: ImageLite | Literal["auto"] | None = "auto",
        allow_internet: bool = False,
        service_images: Mapping[str, ImageLite] | None = None,
    ) -> None:
        self.task = task
        self.scheme = scheme
        self.reward_key = reward_key
        self.image: ImageLite | None = None
        self.services: HelperServices | None = None
        """The compose file's helper services, running beside this attempt's environment (none without helpers)."""
        self.command_timeout_s = command_timeout_s
        self.command_limits = task.agent_limits(command_timeout_s)
        self.attempt = task.open_attempt(seed_app=False)
        try:
            self.sandbox = (make_attempt_sandbox or sandbox_factory())(self.attempt)
            self.toolchain = find_toolchain() if toolchain == "auto" else toolchain
            if isinstance(self.sandbox, ContainerSandbox):  # the task's own image, its /app as built
                prepare_container(task, self.sandbox, allow_internet)
            else:
                self._enter(image, service_images)
            public = allow_internet and task.environment.network == "public" and self.services is None
            if public and isinstance(self.sandbox, BubblewrapSandbox):
                self.sandbox.agent_network = self.sandbox.verifier_network = True
            if self.toolchain is not None and self.sandbox.can_share:
                attach(self.sandbox, self.toolchain)
            if isinstance(self.sandbox, LiveBubblewrapSandbox):  # ready before the agent's first command, timed
                if self.services is not None:  # as set-up (an image's service, the helpers, start now)
                    self.services.start()
                self.sandbox.start(self.command_limits)
        except BaseException:
            self.close()
            raise
        self.verification: VerifierResult | None = None

    def _enter(self, image: ImageLite | Literal["auto"] | None, service_images) -> None:
        """Seed ``/app`` from the task's files, or enter its image (with its helper services beside it)."""
        self.image = image_for(self.task, image)
        if self.image is None:
            self.task.seed_app(self.attempt)
            return
        hosts, volumes = (), None
        if self.task.needs.helpers:
            if not isinstance(self.sandbox, LiveBubblewrapSandbox):
                raise SandboxUnavailableError(
                    f"task {self.task.name!r} has helper services, which run beside a live environment "
                    "(sandbox.backend='bubblewrap') or with an engine's compose (docker, podman)"
                )
            limits = self.task.sandbox_limits(service_lifetime_s(self.task))
            self.services = HelperServices(self.task, limits, service_images, self.toolchain)
            self.sandbox.network = self.services.network
            hosts, volumes = self.services.hosts, self.services.volumes_of(self.task.needs.compose.main)
        enter_image(self.image, self.task, self.attempt, self.sandbox, hosts, volumes)

    @property
    def workdir(self) -> str:
        """Where commands start: ``[environment] workdir``, else the image's ``WORKDIR``, else ``/app``."""
        return self.task.workdir

    def run_command(self, command: str) -> CommandResult:
        """Run one agent command in the working directory; its failures come back in the result, never raised."""
        return self.sandbox.run(
            command, limits=self.command_limits, mounts=("app",), cwd=self.workdir, env=self.task.command_env
        )

    def run_solution(self, solution_dir: Path | None = None, timeout_s: float | None = None) -> CommandResult:
        """Run the reference solution (the task's, or a step's ``solution_dir``) as the oracle agent."""
        return run_reference_solution(self.task, self.sandbox, solution_dir, timeout_s)

    def upload(self, source: Path, target: str) -> None:
        """Copy the directory ``source``'s contents into ``target`` inside the environment (files the agent then
        sees, e.g. a step's ``workdir/``).

        Raises:
            ValueError: ``target`` is not under ``/app`` (the only place this sandbox can write).
            OSError: the agent left a directory where ``source`` has a file, or changed the tree during the copy.
        """
        if isinstance(self.sandbox, ContainerSandbox):
            self.sandbox.copy_into(str(source), target)
            return
        relative = posixpath.relpath(posixpath.normpath(target), APP)
        if relative.startswith(".."):
            raise ValueError(f"cannot place files at {target}: this environment shows only {APP}")
        try:
            place_tree(source, self.attempt.app, relative)  # /app is the agent's: never write through its links
        finally:
            self.attempt.wrote_from_host()  # even a failed copy may have placed some files

    def verify(self, tests: Path | None = None, settings: VerifierSettings | None = None) -> float:
        """Run the task's verifier (or ``tests`` with ``settings``, a step's) and return the reward (0 with a
        reason when it fails)."""
        self.verification = run_verifier(self.task, self.sandbox, self.scheme, self.reward_key, tests, settings)
        return self.verification.reward

    def close(self) -> None:
        """End the attempt's environment and its helper services (every process in them) and remove their
        directories; idempotent."""
        try:
            if hasattr(self, "sandbox"):
                self.sandbox.close()
        finally:
            try:
                if self.services is not None:
                    self.services.close()
            finally:
                self.attempt.close()

    def __enter__(self) -> TerminalTaskAttempt:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
