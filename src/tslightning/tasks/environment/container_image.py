"""A task's image for the container backends: its ``docker_image``, or its Dockerfile built once per content hash.

As Harbor: a task that names a prebuilt ``[environment] docker_image`` runs in it (the engine pulls it); otherwise its
``environment/Dockerfile`` is built with the engine (``build --tag tslightning-task/<name>:<hash> --file ...``), where
the hash covers every file of the build context, so an unchanged task is built once (``image inspect`` finds it).
A task with neither runs in the container backends' default image.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from tslightning.sandbox import ContainerSandbox
from tslightning.sandbox.docker import DEFAULT_IMAGE
from tslightning.tasks.environment.image_lite import ImageBuildError
from tslightning.tasks.terminal_task import TerminalTask, compose_variables

COMPOSE_START_S = 300.0
"""How long ``compose up --wait`` may wait for the services to be healthy, beyond building their images."""


def context_digest(context: Path) -> str:
    """A content hash of a build context: every file's relative path, mode and bytes."""
    digest = hashlib.sha256()
    for path in sorted(context.rglob("*")):
        if path.is_file() and not path.is_symlink():
            digest.update(f"{path.relative_to(context)}|{path.stat().st_mode & 0o777}|".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:20]


def container_image(task: TerminalTask, cli: str) -> str:
    """The image ``task``'s container runs (see the module docstring), built with ``cli`` when needed.

    Raises:
        ImageBuildError: the engine's build failed (its output's tail is in the message).
    """
    if task.environment.docker_image:
        return task.environment.docker_image
    if task.dockerfile is None:
        return DEFAULT_IMAGE
    tag = f"tslightning-task/{task.name.lower()}:{context_digest(task.environment_dir)}"
    found = subprocess.run([cli, "image", "inspect", tag], capture_output=True, timeout=60)
    if found.returncode == 0:
        return tag
    build = [cli, "build", "--tag", tag, "--file", str(task.dockerfile), str(task.environment_dir)]
    try:
        done = subprocess.run(build, capture_output=True, text=True, timeout=task.environment.build_timeout_sec)
    except subprocess.TimeoutExpired as error:
        raise ImageBuildError(f"{cli} build of {task.name!r} ran past build_timeout_sec") from error
    if done.returncode != 0:
        raise ImageBuildError(f"{cli} build of {task.name!r} failed: {(done.stdout + done.stderr).strip()[-1500:]}")
    return tag


def prepare_container(task: TerminalTask, sandbox: ContainerSandbox, allow_internet: bool) -> None:
    """Point ``sandbox`` at ``task``'s image, start-up command, working directory, CPUs, network and, for a task
    with helper containers, its compose file."""
    sandbox.image = container_image(task, sandbox.cli)
    sandbox.start_command = task.needs.start_command
    sandbox.workdir = task.workdir
    sandbox.cpus = float(task.environment.cpus)
    sandbox.network = allow_internet and task.environment.network == "public"
    if task.needs.helpers and task.compose_file is not None:
        sandbox.compose_file = task.compose_file  # its helper services run with compose
        sandbox.compose_env = compose_variables(task.root, task.environment)
        sandbox.compose_timeout_s = task.environment.build_timeout_sec + COMPOSE_START_S
