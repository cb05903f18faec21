"""The host commands that start a sandbox's bwrap through the root launcher
(:mod:`~tslightning.sandbox.verifier_launcher`): a live environment in a network of its own or the attempt's, and a
verifier beside it with idmapped binds of the agent's files."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

LAUNCHER = Path(__file__).with_name("verifier_launcher.py")
ENVIRONMENT_LAUNCHER = LAUNCHER
"""The same script starting a live environment (its own network, no idmapped binds: it runs wherever bwrap does)."""


def beside_argv(
    verifier_uid: int,
    agent_uid: int,
    netns_fd: int | None,
    idmapped: Iterable[str | os.PathLike[str]],
    bwrap_argv: Sequence[str],
) -> list[str]:
    """The host command (run as root) that starts the verifier's bwrap: in the network namespace open at
    ``netns_fd`` (None: the trainer's), with the ``idmapped`` host directories showing ``agent_uid``'s files as
    ``verifier_uid``'s, then as ``verifier_uid`` (see :mod:`~tslightning.sandbox.verifier_launcher`)."""
    argv = [sys.executable, "-I", "-S", "-B", str(LAUNCHER)]
    if netns_fd is not None:
        argv += ["--net", str(netns_fd)]
    argv += ["--uid", str(verifier_uid), "--agent-uid", str(agent_uid)]
    for path in idmapped:
        argv += ["--idmap", os.fspath(path)]
    return [*argv, "--", *bwrap_argv]


def environment_argv(agent_uid: int, bwrap_argv: Sequence[str], netns_fd: int | None = None) -> list[str]:
    """The host command (run as root) that starts a live environment's bwrap as ``agent_uid`` in a network namespace
    of its own (loopback up, every port bindable, as in a container), or in the attempt's network open at
    ``netns_fd`` (:class:`~tslightning.sandbox.attempt_network.AttemptNetwork`; see
    :mod:`~tslightning.sandbox.verifier_launcher`); ``bwrap_argv`` must not unshare the network itself."""
    network = ["--new-net", "1"] if netns_fd is None else ["--net", str(netns_fd)]
    launcher = [sys.executable, "-I", "-S", "-B", str(ENVIRONMENT_LAUNCHER), *network]
    return [*launcher, "--uid", str(agent_uid), "--agent-uid", str(agent_uid), "--", *bwrap_argv]


__all__ = ["ENVIRONMENT_LAUNCHER", "LAUNCHER", "beside_argv", "environment_argv"]
