"""Where every agent-executed command and every task verifier runs: isolated, limited, and reported.

``AttemptDirectory`` holds one attempt's ``/app``, ``/tests``, ``/logs/verifier`` and ``/oracle``;
``make_sandbox(backend, attempt=...)`` gives a ``Sandbox`` whose ``run(command)`` returns a ``CommandResult``:
exit status, bounded terminal output, and which ``SandboxLimits`` limit (if any) stopped the command. In the default
bubblewrap backend, pid 1 of each sandbox is :mod:`~tslightning.sandbox.init_process` (whole-command memory and
disk, orphans of verifier runs), a :mod:`~tslightning.sandbox.syscall_filter` refuses keyrings, affinity changes and
foreign limits, and :mod:`~tslightning.sandbox.file_tree` walks whatever trees a command leaves.

:class:`~tslightning.sandbox.live_environment.LiveBubblewrapSandbox` keeps one live environment per attempt (what an
agent command leaves running is there for the next), as Harbor's one container per attempt;
:class:`~tslightning.sandbox.attempt_network.AttemptNetwork` is one attempt's network, shared by its environment,
its helper services and its verifier (a compose project's network).

Layer: at the bottom; imports nothing else of tslightning.
"""

from tslightning.sandbox.attempt import MOUNT_POINTS, AttemptDirectory, Mount
from tslightning.sandbox.attempt_network import AttemptNetwork
from tslightning.sandbox.base import BASE_ENVIRONMENT, Sandbox
from tslightning.sandbox.bubblewrap import BubblewrapSandbox
from tslightning.sandbox.container import ContainerSandbox
from tslightning.sandbox.docker import DockerSandbox
from tslightning.sandbox.errors import SandboxError, SandboxUnavailableError
from tslightning.sandbox.factory import Backend, make_sandbox
from tslightning.sandbox.limits import OUTPUT_KILL_FACTOR, SandboxLimits
from tslightning.sandbox.live_environment import LiveBubblewrapSandbox
from tslightning.sandbox.plain_subprocess import SubprocessSandbox
from tslightning.sandbox.result import CommandResult, LimitName, OrphanProcess

__all__ = [
    "BASE_ENVIRONMENT",
    "MOUNT_POINTS",
    "OUTPUT_KILL_FACTOR",
    "AttemptDirectory",
    "AttemptNetwork",
    "Backend",
    "BubblewrapSandbox",
    "CommandResult",
    "ContainerSandbox",
    "DockerSandbox",
    "LimitName",
    "LiveBubblewrapSandbox",
    "Mount",
    "OrphanProcess",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "SandboxUnavailableError",
    "SubprocessSandbox",
    "make_sandbox",
]
