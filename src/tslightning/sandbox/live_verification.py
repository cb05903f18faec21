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
**different host uid** (:data:`DEFAULT_VERIFIER_UID`): even a process that learnt the verifier's pids or the log
directory's host path could neither signal them, nor open their ``/proc`` entries, nor the directory, which belongs
to that uid with mode 0700.

How the verifier reads and writes the agent's files under another uid: through *idmapped* mounts
(:mod:`~tslightning.sandbox.verifier_launcher`). Its ``/app`` and the root's writable copies are binds in which the
agent's host uid and gid show as the verifier's, so it owns the agent's files as the agent does (as root in a
Harbor container: an owner-only ``chmod 600`` file is readable, modes are unchanged), and what it writes there is
the agent's on disk (the agent's still-running services keep owning everything). The launcher runs as root on the
host (the trainer), in a private mount namespace of its own: nothing it mounts shows on the host, and it all goes
with the verifier.

The verifier's commands are a verifier run in every other respect (orphans killed, ptrace refused, an untraceable
shell). Afterwards the live environment ends (see
:meth:`~tslightning.sandbox.live_environment.LiveBubblewrapSandbox.run`).
"""

from __future__ import annotations

import os
import stat

from tslightning.sandbox.attempt import AttemptDirectory, Mount
from tslightning.sandbox.bubblewrap import DEFAULT_UNPRIVILEGED_UID, _hand_over
from tslightning.sandbox.errors import SandboxError
from tslightning.sandbox.host_launcher import ENVIRONMENT_LAUNCHER, LAUNCHER, beside_argv, environment_argv

DEFAULT_VERIFIER_UID = DEFAULT_UNPRIVILEGED_UID + 1
"""Host uid (and gid) of a verifier run beside a live environment; distinct from the agent's."""
LOG_MODE = 0o700


def hand_over_to_verifier(
    attempt: AttemptDirectory,
    mounts: tuple[Mount, ...],
    agent_uid: int,
    verifier_uid: int,
    kept: tuple[Mount, ...] = ("tests",),
) -> None:
    """Give the verifier's directories their owners: ``/logs/verifier`` to ``verifier_uid`` (mode 0700), the others
    (``/app``) to the agent's uid as for its own commands (the verifier sees them through idmapped binds), and the
    attempt's root (and ``logs/``) searchable by the verifier's group; the ``kept`` mounts' files keep their owners.

    Raises:
        SandboxError: a directory could not be handed over.
    """
    _hand_over(attempt, tuple(mount for mount in mounts if mount != "logs"), agent_uid, kept)
    logs = attempt.host_path("logs")
    try:
        for parent in (attempt.root, *(p for p in logs.parents if attempt.root in p.parents)):
            os.chown(parent, agent_uid, verifier_uid, follow_symlinks=False)
            mode = stat.S_IMODE(os.lstat(parent).st_mode)
            os.chmod(parent, mode | stat.S_IXGRP, follow_symlinks=False)
        if logs.is_symlink() or not logs.is_dir():
            raise SandboxError(f"the verifier's log directory {logs} is not a directory")
        os.chown(logs, verifier_uid, verifier_uid, follow_symlinks=False)
        os.chmod(logs, LOG_MODE, follow_symlinks=False)
    except OSError as error:
        raise SandboxError(f"could not hand the verifier's directories to uid {verifier_uid}: {error}") from error


__all__ = [
    "DEFAULT_VERIFIER_UID",
    "ENVIRONMENT_LAUNCHER",
    "LAUNCHER",
    "beside_argv",
    "environment_argv",
    "hand_over_to_verifier",
]
