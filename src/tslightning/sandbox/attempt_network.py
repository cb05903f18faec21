"""One attempt's network, shared by its live environment, its helper services and its verifier, as a compose
project's services share their network.

A network namespace with loopback up and every port bindable by every uid (as in a container), made by the
environment launcher (:mod:`~tslightning.sandbox.verifier_launcher` ``--new-net``) in a short-lived process and kept
by an open descriptor: the namespace lives while the attempt holds it (or a process is still in it), not with any
one process, so the live environment can end and start again (a multi-step task's next step) in the same network,
where its helper services still answer. Every sandbox of the attempt enters it from the host before dropping to its
uid (``--net``); nothing in it reaches the outside, nor any other attempt's network.

Making and entering a network namespace from the host needs a root trainer (as image-lite builds do).
"""

from __future__ import annotations

import os
import subprocess

from tslightning.sandbox.base import DEFAULT_PATH
from tslightning.sandbox.errors import SandboxError, SandboxUnavailableError
from tslightning.sandbox.host_launcher import environment_argv

START_TIMEOUT_S = 30.0
_HOLD = "echo . && read _"
"""The short-lived process: says it is in the new namespace, then waits until the trainer opened it."""


class AttemptNetwork:
    """The attempt's network namespace, held open until :meth:`close` (see the module docstring).

    Args:
        uid: Host uid the short-lived process runs as once the namespace is made.

    Raises:
        SandboxUnavailableError: the trainer is not root.
        SandboxError: the namespace could not be made (the launcher's message included).
    """

    def __init__(self, uid: int) -> None:
        if os.geteuid() != 0:
            raise SandboxUnavailableError(
                "helper services share the attempt's own network, which the trainer makes as root; run it as root"
            )
        holder = subprocess.Popen(
            environment_argv(uid, ["/bin/sh", "-c", _HOLD]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": DEFAULT_PATH},
            start_new_session=True,
        )
        try:
            said = holder.stdout.read(2)
            if said != b".\n":
                raise SandboxError(f"could not make the attempt's network: {holder.stderr.read().decode().strip()}")
            self._fd: int | None = os.open(f"/proc/{holder.pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            holder.stdin.close()
            try:
                holder.wait(timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                holder.kill()
                holder.wait()
            holder.stdout.close()
            holder.stderr.close()

    @property
    def fd(self) -> int:
        """The namespace's descriptor (close-on-exec: hand a duplicate to a launcher).

        Raises:
            RuntimeError: the network was closed.
        """
        if self._fd is None:
            raise RuntimeError("the attempt's network is closed")
        return self._fd

    @property
    def closed(self) -> bool:
        return self._fd is None

    def inode(self) -> int:
        """The namespace's inode (a process is in this network when ``/proc/PID/ns/net`` has it)."""
        return os.fstat(self.fd).st_ino

    def close(self) -> None:
        """Let go of the namespace (it ends with the last process in it); idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


__all__ = ["AttemptNetwork"]
