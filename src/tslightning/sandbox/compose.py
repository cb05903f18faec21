"""Tasks with helper containers (a ``docker-compose.yaml`` with services besides the task's own), as Harbor runs
them: ``<cli> compose`` starts every service of the task's compose file, and the agent's commands are ``exec``s in
its ``main`` service, exactly as in a one-container attempt.

The task's compose file is used as published, its ``${VAR}`` values interpolated from the task's ``[environment]
env`` and Harbor's compose variables, and started as Harbor starts it (``up --detach --wait``: every service with a
healthcheck healthy first); a second file, written for the attempt, overrides the ``main``
service with what the one-container backend sets on ``docker run``: the attempt's container name (so ``exec`` and
``cp`` address it), the task's image (built or pulled once per content hash), ``sleep infinity`` under ``--init``,
the memory, process, CPU and ``/tmp`` limits, no ``NET_RAW``, no new privileges, a label; and the project's default
network is ``internal`` (the services reach one another, not the outside) unless the network is allowed. The file is
JSON, which compose reads as YAML. The project (every service, its volumes and networks) is removed with
``compose down`` when the attempt ends.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tslightning.sandbox.limits import SandboxLimits

MAIN_SERVICE = "main"
"""The service the agent's commands run in (Harbor's name for the task's own container)."""
PROBE_TIMEOUT_S = 30.0


def compose_available(cli: str) -> bool:
    """Whether ``<cli> compose`` answers (``compose version``)."""
    try:
        probe = subprocess.run([cli, "compose", "version"], capture_output=True, timeout=PROBE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def compose_override(name: str, image: str, limits: SandboxLimits, cpus: float, network: bool) -> str:
    """The attempt's override of the ``main`` service and the default network (see the module docstring)."""
    main = {
        "container_name": name,
        "image": image,
        "init": True,
        "entrypoint": ["sleep"],
        "command": ["infinity"],
        "mem_limit": limits.memory_bytes,
        "memswap_limit": limits.memory_bytes,
        "pids_limit": limits.max_processes,
        "cpus": cpus,
        "tmpfs": [f"/tmp:rw,exec,size={limits.tmp_bytes}"],
        "cap_drop": ["NET_RAW"],
        "security_opt": ["no-new-privileges"],
        "labels": {"tslightning.attempt": "1"},
    }
    document = {"services": {MAIN_SERVICE: main}, "networks": {"default": {"internal": not network}}}
    return json.dumps(document, indent=1)


def compose_argv(cli: str, project: str, files: tuple[Path, ...], *action: str) -> list[str]:
    """``<cli> compose --project-name PROJECT --project-directory DIR --file FILE... ACTION...``, the directory the
    task's compose file's (its relative paths resolve there, as Harbor runs it)."""
    argv = [cli, "compose", "--project-name", project, "--project-directory", str(files[0].parent)]
    for file in files:
        argv += ["--file", str(file)]
    return [*argv, *action]


__all__ = ["MAIN_SERVICE", "compose_argv", "compose_available", "compose_override"]
