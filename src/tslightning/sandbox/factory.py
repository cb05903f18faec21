"""``make_sandbox``: the one place a ``sandbox.backend`` name becomes a sandbox."""

from __future__ import annotations

from typing import Literal, get_args

from tslightning.sandbox.attempt import AttemptDirectory
from tslightning.sandbox.base import Sandbox
from tslightning.sandbox.bubblewrap import BubblewrapSandbox
from tslightning.sandbox.container import ContainerSandbox
from tslightning.sandbox.docker import DEFAULT_IMAGE, DockerSandbox
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.live_environment import LiveBubblewrapSandbox
from tslightning.sandbox.plain_subprocess import SubprocessSandbox

Backend = Literal["bubblewrap", "docker", "podman", "subprocess"]
"""The sandbox backends :func:`make_sandbox` builds (``sandbox.backend``)."""


def make_sandbox(
    backend: Backend = "bubblewrap",
    *,
    attempt: AttemptDirectory,
    limits: SandboxLimits | None = None,
    live: bool = False,
) -> Sandbox:
    """The sandbox of ``attempt`` for the configured ``sandbox.backend``.

    Args:
        backend: ``"bubblewrap"`` (default: isolated, needs bwrap), ``"docker"`` (needs a running engine) or
            ``"subprocess"`` (no isolation; warns).
        attempt: the attempt whose directories the commands see.
        limits: the default limits of every ``run``.
        live: one live environment for the attempt's agent commands, where the backend has one
            (``bubblewrap``: :class:`~tslightning.sandbox.live_environment.LiveBubblewrapSandbox`; ``docker``: one
            container per attempt, :class:`~tslightning.sandbox.container.ContainerSandbox`, as ``podman`` always);
            otherwise each command runs in a fresh one.

    Raises:
        ValueError: ``backend`` is not one of the names above.
        SandboxUnavailableError: the backend cannot run on this machine; the message names ``sandbox.backend``
            and the fix (e.g. ``apt-get install bubblewrap``).
    """
    if backend == "bubblewrap":
        return (LiveBubblewrapSandbox if live else BubblewrapSandbox)(attempt, limits=limits)
    if backend == "podman" or (backend == "docker" and live):
        return ContainerSandbox(attempt, image=DEFAULT_IMAGE, engine=backend, limits=limits)
    if backend == "docker":
        return DockerSandbox(attempt, limits=limits)
    if backend == "subprocess":
        return SubprocessSandbox(attempt, limits=limits)
    raise ValueError(f"sandbox.backend must be one of {list(get_args(Backend))} (got {backend!r})")
