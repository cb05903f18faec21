"""An explicit opt-out: commands run as plain host subprocesses, with limits and a timeout but no isolation."""

from __future__ import annotations

import logging
import shutil
import warnings

from tslightning.sandbox.attempt import MOUNT_POINTS, AttemptDirectory
from tslightning.sandbox.base import Sandbox, limits_script
from tslightning.sandbox.limits import SandboxLimits
from tslightning.sandbox.supervision import CommandRequest, Launch

log = logging.getLogger(__name__)

NOT_ISOLATED = (
    "SubprocessSandbox does NOT isolate: commands run on the host as the trainer's user, with its filesystem, "
    "network and processes in reach; only the kernel limits and the timeout apply (and, for root, no process "
    "limit). Use it only for trusted commands; sandbox.backend='bubblewrap' isolates."
)


class SubprocessSandbox(Sandbox):
    """Runs each command with ``bash -c`` on the host, in the attempt's host directories.

    Only ``cwd`` is translated: ``/app`` (or another mount point, or a path below one) becomes the attempt's host
    directory; paths inside the command are not rewritten, and ``mounts`` cannot hide anything. Processes that leave
    the command's session (``setsid``) escape the kill.

    Warns:
        UserWarning: on construction, always (and logs it), because nothing is isolated.
    """

    can_share = False

    def __init__(self, attempt: AttemptDirectory, *, limits: SandboxLimits | None = None) -> None:
        super().__init__(attempt, limits=limits)
        warnings.warn(NOT_ISOLATED, UserWarning, stacklevel=2)
        log.warning(NOT_ISOLATED)
        self._bash = shutil.which("bash") or "/bin/bash"

    def _launch(self, request: CommandRequest) -> Launch:
        script = limits_script(request.limits, ready_fd=request.ready_fd, shell=self._bash)
        argv = [self._bash, "-c", script, "tsl-sandbox", request.command]
        return Launch(argv=argv, env=request.env, cwd=self._host_cwd(request.cwd))

    def _host_cwd(self, cwd: str) -> str:
        for mount, point in MOUNT_POINTS.items():
            if cwd == point or cwd.startswith(point + "/"):
                return str(self.attempt.host_path(mount)) + cwd[len(point) :]
        return cwd
