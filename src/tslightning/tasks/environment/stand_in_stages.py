"""Images a Dockerfile's ``COPY --from`` may name although no engine pulls them here: those whose files a PyPI
package ships as they are.

astral's ``ghcr.io/astral-sh/uv[:VERSION]`` image holds only the ``uv`` and ``uvx`` binaries of the ``uv`` wheel
(``COPY --from=ghcr.io/astral-sh/uv:latest /uv /uvx /bin/``, as Harbor's MCP example does). The image-lite builder
takes them from that wheel (``latest``: the trainer's own uv), laid out as the image lays them out and cached beside
the built images; any other image named by ``COPY --from`` needs the image itself.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tslightning.tasks.environment.offline_toolchain import uv_binary
from tslightning.tasks.harbor.environment_needs import STAND_IN_STAGES, stand_in_package

_FETCH_TIMEOUT_S = 300.0


class StageError(RuntimeError):
    """The stage's files could not be had (the message says why).

    Attributes:
        needs: ``needs image`` when the image is not one a wheel stands in for, else ``None``.
    """

    def __init__(self, message: str, needs: str | None = None) -> None:
        super().__init__(message)
        self.needs = needs


def stage_files(image: str, images: Path) -> Path:
    """A directory laid out as ``image`` (``/uv``, ``/uvx``), made once under ``images`` (see the module docstring).

    Raises:
        StageError: ``image`` is not one a wheel stands in for, or its wheel could not be had.
    """
    if stand_in_package(image) != "uv":
        raise StageError(f"COPY --from={image}: a file from another image", needs="needs image")
    reference = image.split("@", 1)[0].rsplit("/", 1)[-1]
    tag = reference.rsplit(":", 1)[1] if ":" in reference else "latest"
    stage = images / f"stage-uv-{tag}"
    images.mkdir(parents=True, exist_ok=True)
    with open(images / f"{stage.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (stage / "uv").is_file() and (stage / "uvx").is_file():
            return stage
        building = images / f".building-{stage.name}-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir()
        try:
            _fetch_uv(tag, building)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        os.replace(building, stage)
    return stage


def _fetch_uv(tag: str, target: Path) -> None:
    """``uv`` and ``uvx`` of version ``tag`` (``latest``: the trainer's) into ``target``."""
    if tag == "latest":
        try:
            uv = uv_binary()
        except FileNotFoundError as error:
            raise StageError(f"COPY --from=ghcr.io/astral-sh/uv:latest: {error}") from error
        shutil.copy2(uv, target / "uv")
        if uv.with_name("uvx").is_file():
            shutil.copy2(uv.with_name("uvx"), target / "uvx")
        else:  # uvx is `uv tool run`
            (target / "uvx").write_text('#!/bin/sh\nexec "$(dirname "$0")/uv" tool run "$@"\n')
            (target / "uvx").chmod(0o755)
        return
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    command += ["--platform", "manylinux_2_17_x86_64", "--dest", str(target), f"uv=={tag}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=_FETCH_TIMEOUT_S)
    wheels = list(target.glob("uv-*.whl"))
    if done.returncode != 0 or not wheels:
        raise StageError(f"COPY --from=ghcr.io/astral-sh/uv:{tag}: pip download uv=={tag} failed: {done.stderr[-500:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        for name in ("uv", "uvx"):
            member = next(m for m in wheel.namelist() if m.endswith(f".data/scripts/{name}"))
            (target / name).write_bytes(wheel.read(member))
            (target / name).chmod(0o755)
    wheels[0].unlink()


__all__ = ["STAND_IN_STAGES", "StageError", "stage_files", "stand_in_package"]  # the last two read in harbor/
