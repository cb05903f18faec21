"""An attempt inside a task's image-lite environment: ``/app`` seeded from the image, private writable copies, the
sandbox in the image's root, and the image's start-up command running in the live environment.

A task whose environment needs a build (:mod:`~tslightning.tasks.harbor.environment_needs`) gets its image from
:func:`~tslightning.tasks.environment.image_lite.build_image` (cached by content hash, so every attempt after the first
finds it). Each attempt then sees the image's root read-only, its own copies of the image's ``/app``, working directory,
``/root``, ``/home`` and ``/var/tmp`` writable, and the image's ``CMD`` started in the background when the
environment starts (see :class:`~tslightning.sandbox.live_environment.LiveBubblewrapSandbox`). An image with a
non-root ``USER`` runs the agent's commands and ``CMD`` as that user, the copies keeping the image's owners
(:mod:`~tslightning.tasks.environment.image_user`).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from tslightning.sandbox import AttemptDirectory, BubblewrapSandbox, LiveBubblewrapSandbox, Sandbox
from tslightning.sandbox.errors import SandboxUnavailableError
from tslightning.sandbox.root_filesystem import RootFilesystem
from tslightning.sandbox.tree_copy import copy_tree
from tslightning.tasks.environment.image_lite import WRITABLE, ImageLite, build_image
from tslightning.tasks.environment.image_user import ROOT_IDS, carry_ownership, home_of
from tslightning.tasks.terminal_task import TerminalTask

APP = "/app"
PRIVATE_FILES = ("/etc/hosts",)
"""Files of the image each attempt gets a private writable copy of, as Docker bind-mounts its own per container (an
entrypoint routes host names to a local service with ``echo "127.0.0.1 NAME" >> /etc/hosts``)."""


def image_for(task: TerminalTask, image: ImageLite | Literal["auto"] | None) -> ImageLite | None:
    """``image``, or with ``"auto"`` the task's built image when its environment needs a build (else ``None``).

    Raises:
        ImageBuildError: the build failed or cannot run here.
    """
    if image != "auto":
        return image
    if task.needs.status != "build" or task.dockerfile is None:
        return None
    return build_image(task.dockerfile, timeout_s=task.environment.build_timeout_sec)


def enter_image(
    image: ImageLite,
    task: TerminalTask,
    attempt: AttemptDirectory,
    sandbox: Sandbox,
    hosts: Sequence[tuple[str, str]] = (),
    volumes: Mapping[str, Path] | None = None,
) -> None:
    """Prepare ``attempt`` and ``sandbox`` to run in ``image`` (see the module docstring), with ``hosts`` (name,
    address) added to its ``/etc/hosts`` and ``volumes`` (path inside → host directory) bound writable.

    Raises:
        SandboxUnavailableError: the backend cannot run commands in a built root (only bubblewrap can).
        ValueError: a volume's path does not exist in the image (a read-only root cannot grow it).
    """
    enter_root(image, attempt, sandbox, task.workdir, task.name, hosts, volumes)
    if image.start_command and isinstance(sandbox, LiveBubblewrapSandbox):
        sandbox.startup = (image.start_command, task.workdir, task.command_env)


def enter_root(
    image: ImageLite,
    attempt: AttemptDirectory,
    sandbox: Sandbox,
    workdir: str,
    name: str,
    hosts: Sequence[tuple[str, str]] = (),
    volumes: Mapping[str, Path] | None = None,
) -> None:
    """Show ``image``'s root to ``sandbox``'s commands with the attempt's private copies (``/app`` seeded from the
    image, ``workdir`` and :data:`WRITABLE`, :data:`PRIVATE_FILES`), for the task or helper service ``name``.

    Raises:
        SandboxUnavailableError: the backend cannot run commands in a built root (only bubblewrap can).
        ValueError: a volume's path does not exist in the image.
    """
    if not isinstance(sandbox, BubblewrapSandbox):
        raise SandboxUnavailableError(
            f"task {name!r} runs in an image-lite environment, which needs sandbox.backend='bubblewrap'"
        )
    image_app = image.rootfs / APP.lstrip("/")
    attempt.wrote_from_host()
    if image_app.is_dir():
        copy_tree(image_app, attempt.app)
    writable = {}
    candidates = list(dict.fromkeys([workdir, *WRITABLE]))
    for inside in candidates:
        source = image.rootfs / inside.lstrip("/")
        if inside in ("/", APP) or inside.startswith(f"{APP}/") or not source.is_dir():
            continue
        if any(inside.startswith(f"{other.rstrip('/')}/") for other in candidates if other != "/"):
            continue  # inside another copy (a working directory under /home): that copy holds it
        host = attempt.root / "image-rw" / inside.lstrip("/")
        copy_tree(source, host)
        writable[inside] = host
    owned = (image.uid, image.gid) != ROOT_IDS
    if owned:
        _enter_as_user(image, name, sandbox, [(image_app, attempt.app), *_sources(image, writable)])
    for inside, host in (volumes or {}).items():
        if not (image.rootfs / inside.lstrip("/")).is_dir():
            raise ValueError(
                f"{name}: volume {inside} is not a directory in the image (a read-only root cannot grow it)"
            )
        writable[inside] = host
    files = _private_files(image, attempt, hosts)
    sandbox.use_root(RootFilesystem(image.rootfs, writable, files=files), owned=owned)


def _private_files(
    image: ImageLite, attempt: AttemptDirectory, hosts: Sequence[tuple[str, str]] = ()
) -> dict[str, Path]:
    """The attempt's own copies of :data:`PRIVATE_FILES` (root's, as Docker's are: a ``USER`` cannot write them),
    ``/etc/hosts`` naming ``hosts`` (a compose project's services) as Docker's network names them."""
    files = {}
    for inside in PRIVATE_FILES:
        source = image.rootfs / inside.lstrip("/")
        if source.is_symlink() or not source.is_file():
            continue
        copy = attempt.root / "image-files" / inside.lstrip("/").replace("/", "-")
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, copy)
        if inside == "/etc/hosts" and hosts:
            with copy.open("a", encoding="utf-8") as table:
                table.writelines(f"{address}\t{name}\n" for name, address in hosts)
        files[inside] = copy
    return files


def _enter_as_user(image: ImageLite, name: str, sandbox: BubblewrapSandbox, copies) -> None:
    """Run the agent's commands as the image's ``USER``, its files in the attempt's copies its own
    (:mod:`~tslightning.tasks.environment.image_user`).

    Raises:
        SandboxUnavailableError: the trainer is not root (the copies cannot keep the image's owners).
    """
    if sandbox.host_uid is None:
        raise SandboxUnavailableError(
            f"task {name!r}: its image runs as USER {image.user}, which needs the trainer to run as root "
            "(the attempt's files keep the image's owners)"
        )
    sandbox.identity = (image.uid, image.gid)
    sandbox.home = home_of(image.rootfs, image.uid)
    for source, copy in copies:
        if source.is_dir():
            carry_ownership(source, copy, sandbox.identity, sandbox.host_uid)


def _sources(image: ImageLite, writable: dict[str, Path]) -> list[tuple[Path, Path]]:
    return [(image.rootfs / inside.lstrip("/"), host) for inside, host in writable.items()]
