"""A verifier run beside a live environment: the agent's processes keep running, the verifier cannot be reached.

Harbor runs a task's tests in the agent's own container, so a task may ask for a service the agent leaves running
("serve X on port 8080"). Here the verifier is a fresh sandbox started next to the live environment, sharing with it
only what a test needs to look at:

- **the network namespace** (entered by ``nsenter`` from the host before anything else): the agent's loopback
  services answer, as in the container; where the agent's and the verifier's network settings differ (one has the
  host's network), the verifier gets its own, as its setting says;
- **the files**: the same root (the image's, or the host's system) with the attempt's writable copies, and ``/app``.

Everything else is its own: a PID namespace (the agent's processes cannot see, signal or trace its processes, nor
open ``/proc/PID/root`` or ``/cwd`` of them), a mount namespace in which alone ``/tests`` (a fresh read-only copy)
and ``/logs/verifier`` exist, a private ``/tmp``, IPC and UTS namespaces, no descriptor of the environment's, and a
**different host uid** (:data:`DEFAULT_VERIFIER_UID`, dropped to by ``setpriv``): even a process that learnt the
verifier's pids or the log directory's host path could neither signal it nor open the directory, which belongs to
that uid with mode 0700.

How the verifier reads the agent's files under another uid: it is started with the agent's host gid as a
supplementary group, so it reads (and writes) what the agent's group may, and what everyone may. The agent's
commands run with umask 022, so what they create is readable by the verifier; a file the agent makes owner-only
(``chmod 600``) is not, as it would not be for a non-root verifier in a container. The verifier's own new files are
its uid's: the agent's processes see them owned by ``nobody``.

The verifier's commands are a verifier run in every other respect (orphans killed, ptrace refused, an untraceable
shell). Afterwards the live environment ends (see
:meth:`~tslightning.sandbox.live_environment.LiveBubblewrapSandbox.run`).
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Sequence

from tslightning.sandbox.attempt import AttemptDirectory, Mount
from tslightning.sandbox.base import DEFAULT_PATH
from tslightning.sandbox.bubblewrap import DEFAULT_UNPRIVILEGED_UID, _hand_over
from tslightning.sandbox.errors import SandboxError

DEFAULT_VERIFIER_UID = DEFAULT_UNPRIVILEGED_UID + 1
"""Host uid (and gid) of a verifier run beside a live environment; distinct from the agent's."""
LOG_MODE = 0o700


def beside_tools() -> tuple[str, str] | None:
    """``(nsenter, setpriv)`` from util-linux, or None when either is missing (the verifier then runs after the
    environment ended, as in a per-command sandbox)."""
    nsenter = shutil.which("nsenter", path=DEFAULT_PATH)
    setpriv = shutil.which("setpriv", path=DEFAULT_PATH)
    return (nsenter, setpriv) if nsenter and setpriv else None


def hand_over_to_verifier(
    attempt: AttemptDirectory, mounts: tuple[Mount, ...], agent_uid: int, verifier_uid: int
) -> None:
    """Give the verifier's directories their owners: ``/logs/verifier`` to ``verifier_uid`` (mode 0700), the others
    (``/app``) to the agent's uid as for its own commands, and the attempt's root (and ``logs/``) searchable by the
    agent's group, of which the verifier is a member.

    Raises:
        SandboxError: a directory could not be handed over.
    """
    _hand_over(attempt, tuple(mount for mount in mounts if mount != "logs"), agent_uid)
    logs = attempt.host_path("logs")
    try:
        for parent in (attempt.root, *(p for p in logs.parents if attempt.root in p.parents)):
            os.chown(parent, agent_uid, agent_uid, follow_symlinks=False)
            mode = stat.S_IMODE(os.lstat(parent).st_mode)
            os.chmod(parent, mode | stat.S_IXGRP, follow_symlinks=False)
        if logs.is_symlink() or not logs.is_dir():
            raise SandboxError(f"the verifier's log directory {logs} is not a directory")
        os.chown(logs, verifier_uid, verifier_uid, follow_symlinks=False)
        os.chmod(logs, LOG_MODE, follow_symlinks=False)
    except OSError as error:
        raise SandboxError(f"could not hand the verifier's directories to uid {verifier_uid}: {error}") from error


def beside_argv(
    tools: tuple[str, str], verifier_uid: int, agent_gid: int, netns_fd: int | None, bwrap_argv: Sequence[str]
) -> list[str]:
    """The host command that starts the verifier's bwrap: in the network namespace open at ``netns_fd`` (None:
    wherever the trainer is), then as ``verifier_uid`` with ``agent_gid`` as its one supplementary group and no
    capability kept on the host (inside, bwrap makes it root of its own user namespace, as any sandbox)."""
    nsenter, setpriv = tools
    argv = [nsenter, f"--net=/proc/self/fd/{netns_fd}", "--"] if netns_fd is not None else []
    argv += [setpriv, f"--reuid={verifier_uid}", f"--regid={verifier_uid}", f"--groups={agent_gid}"]
    return [*argv, "--inh-caps=-all", "--", *bwrap_argv]


__all__ = ["DEFAULT_VERIFIER_UID", "beside_argv", "beside_tools", "hand_over_to_verifier"]
