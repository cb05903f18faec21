"""Image-lite: a task's Dockerfile built as a root filesystem, without a container engine.

The ``FROM`` image is mapped to a Debian root built from the package mirror with ``mmdebstrap`` (:func:`base_for`:
``python:3.X`` → the Debian suite with the nearest Python, plus pip, venv and ``python``; ``debian:<suite>``; and
``ubuntu:*`` → Debian trixie standing in, with ``python3`` added for the sandbox's init). Then the instructions run in
order: ``RUN`` with ``/bin/sh -c`` in bubblewrap, as root of the build, with network to the package registries only
(:mod:`~tslightning.tasks.environment.build_network`: a proxy that refuses other hosts; a Dockerfile that visibly
fetches from elsewhere is refused before any build, one that does it at run time fails as ``needs network at build``);
``COPY`` / ``ADD`` from ``environment/`` (files, directories, globs, local tar archives,
heredocs; ``--chown`` / ``--chmod``); ``WORKDIR`` created; ``ENV`` for the later ``RUN`` steps and the attempts;
``CMD`` / ``ENTRYPOINT`` kept as the environment's start-up command; ``USER``: the later ``RUN`` steps run as that
user (its uid and gid on the host: a user namespace of bwrap's mapping them to themselves), and so do the attempts'
commands and ``CMD`` (:mod:`~tslightning.tasks.environment.image_user`).

Builds are cached by content hash (the mapped base, every instruction, every file of the build context) under
``images/`` of the cache directory (:func:`~tslightning.tasks.environment.offline_toolchain.default_cache_dir`); the
base roots are cached apart, so tasks on the same base build it once. Concurrent builds of one image wait on a lock
file. Builds need root (mmdebstrap's root mode and ``RUN`` as root), ``mmdebstrap`` and ``bwrap``.
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from tslightning.sandbox import BASE_ENVIRONMENT
from tslightning.sandbox.root_filesystem import REQUIRED_DIRS
from tslightning.tasks.environment.build_network import PROXY_ENV, allowed_hosts, run_step
from tslightning.tasks.environment.image_user import ROOT_IDS, home_of, resolve_user
from tslightning.tasks.environment.offline_toolchain import default_cache_dir
from tslightning.tasks.environment.stand_in_stages import StageError, stage_files
from tslightning.tasks.harbor.dockerfile import Dockerfile, Instruction, env_pairs
from tslightning.tasks.harbor.environment_needs import base_of

BUILDER_VERSION = "1"
"""Part of every cache key: a change to how images are built invalidates the cache."""
SUITE_PYTHON = {"bookworm": "3.11", "trixie": "3.13"}
PYTHON_PACKAGES = ("python3", "python3-pip", "python3-venv", "python-is-python3", "ca-certificates")
SYSTEM_PACKAGES = ("python3", "ca-certificates")
WRITABLE = ("/root", "/home", "/var/tmp")
"""Directories of the image every attempt gets a private writable copy of (with the image's working directory)."""
_ARCHIVES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT")
"""Variables naming the CA bundle TLS clients trust (OpenSSL, requests, curl, pip; uv reads ``SSL_CERT_FILE``)."""
STEP_CA_BUNDLE = "/tmp/.tsl-trusted-ca.crt"


class ImageBuildError(RuntimeError):
    """The image could not be built (the message names the Dockerfile line and the output's tail).

    Attributes:
        needs: What the build needed that it could not have here (``needs network at build``), else ``None``.
    """

    def __init__(self, message: str, needs: str | None = None) -> None:
        super().__init__(message)
        self.needs = needs


@dataclass(frozen=True)
class BaseChoice:
    """The Debian root standing in for a ``FROM`` image.

    Attributes:
        system_pip: ``pip install`` installs system-wide (into ``/usr/local``), as in the official ``python`` images:
            Debian's PEP 668 marker (``EXTERNALLY-MANAGED``), which refuses it, is removed from the root.
    """

    suite: str
    packages: tuple[str, ...]
    note: str
    system_pip: bool = False

    @property
    def key(self) -> str:
        pip = "|system-pip" if self.system_pip else ""
        return _digest(f"{BUILDER_VERSION}|{self.suite}|{','.join(self.packages)}{pip}".encode())


@dataclass(frozen=True)
class ImageLite:
    """A built image: its root and what the Dockerfile said about running it.

    Attributes:
        rootfs: The root directory (shown read-only to attempts).
        env: ``ENV`` as the image ends with it.
        workdir: The last ``WORKDIR`` (``/`` when none).
        start_command: ``ENTRYPOINT`` + ``CMD`` as a shell command, or ``None``.
        user: The last ``USER`` as written (``None``: root).
        uid: That user's uid in the image (0 for root).
        gid: Its gid.
        base: How the ``FROM`` image was mapped.
        build_s: Seconds the build took (0 when it came from the cache).
    """

    rootfs: Path
    env: dict[str, str]
    workdir: str
    start_command: str | None
    user: str | None
    base: str
    build_s: float = 0.0
    uid: int = 0
    gid: int = 0


def builder_problem() -> str | None:
    """Why image-lite builds cannot run here, else ``None``."""
    if os.geteuid() != 0:
        return "image-lite builds run as root here (mmdebstrap's root mode, RUN as root); run the trainer as root"
    for tool, package in (("mmdebstrap", "mmdebstrap"), ("bwrap", "bubblewrap")):
        if shutil.which(tool) is None:
            return f"image-lite builds need {tool}: apt-get install {package}"
    return None


def base_for(image: str) -> BaseChoice:
    """The Debian root for ``FROM image`` (see the module docstring).

    Raises:
        ValueError: ``image`` is not one the builder maps.
    """
    mapped = base_of(image)
    if mapped is None:
        raise ValueError(f"FROM {image}: no Debian root stands in for it (needs image)")
    name, tag = mapped
    named = next((suite for suite in ("bookworm", "trixie") if suite in tag), None)
    if name == "python":
        version = tag.split("-")[0]
        suite = named or ("bookworm" if version in ("3", "3.8", "3.9", "3.10", "3.11") else "trixie")
        note = f"python:{tag} → Debian {suite} (Python {SUITE_PYTHON[suite]})"
        return BaseChoice(suite, PYTHON_PACKAGES, note, system_pip=True)
    if name in ("debian", "buildpack-deps"):
        suite = named or ("bookworm" if tag.split("-")[0] in ("12", "bookworm") else "trixie")
        extra = ("curl", "git", "build-essential") if name == "buildpack-deps" else ()
        return BaseChoice(suite, (*SYSTEM_PACKAGES, *extra), f"{name}:{tag} → Debian {suite}")
    return BaseChoice("trixie", SYSTEM_PACKAGES, f"ubuntu:{tag} → Debian trixie standing in (package names shared)")


def image_key(dockerfile: Dockerfile, context: Path) -> str:
    """The content hash of an image: builder version, base, instructions and every file of the build context."""
    digest = hashlib.sha256(f"{BUILDER_VERSION}|{base_for(dockerfile.base_image).key}".encode())
    for instruction in dockerfile.instructions:
        fields = (instruction.keyword, instruction.arguments, instruction.flags, instruction.heredocs)
        digest.update(repr(fields).encode())
        if instruction.keyword == "USER":  # honoured since builder 1 + USER: not an image built before
            digest.update(b"USER honoured")
    for path in sorted(context.rglob("*")):
        if path.is_file() and not path.is_symlink():
            digest.update(f"{path.relative_to(context)}|{path.stat().st_mode & 0o777}|".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def build_image(dockerfile_path: Path, cache_dir: Path | None = None, timeout_s: float = 600.0, log=None) -> ImageLite:
    """The image of ``dockerfile_path`` (its directory is the build context), from the cache or built now.

    Args:
        dockerfile_path: The task's ``environment/Dockerfile``.
        cache_dir: The cache directory (default :func:`default_cache_dir`).
        timeout_s: Wall-clock limit of the whole build (``[environment] build_timeout_sec``).
        log: Where build output goes (a binary file), default none.

    Raises:
        ImageBuildError: a step failed (the message names the line), or the builder cannot run here.
    """
    problem = builder_problem()
    if problem is not None:
        raise ImageBuildError(problem)
    dockerfile = Dockerfile.read(dockerfile_path)
    context = dockerfile_path.parent
    images = (cache_dir or default_cache_dir()) / "images"
    key = image_key(dockerfile, context)
    with _locked(images, key):
        cached = _load(images / key)
        if cached is not None:
            return cached
        started = time.monotonic()
        deadline = started + timeout_s
        choice = base_for(dockerfile.base_image)
        base = _base_root(images, choice, deadline)
        return _build(dockerfile, context, base, images / key, choice, started, deadline, log)


def _build(dockerfile, context, base, target, choice, started, deadline, log) -> ImageLite:
    building = target.with_name(f".building-{target.name}-{os.getpid()}")
    if building.exists():
        shutil.rmtree(building)
    building.mkdir(parents=True)
    rootfs = building / "rootfs"
    subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(rootfs)], check=True)
    state = {"env": {}, "workdir": "/", "start": None, "user": None, "ids": ROOT_IDS, "images": target.parent}
    try:
        for instruction in dockerfile.instructions:
            _apply(instruction, rootfs, context, state, deadline, log)
        for name in REQUIRED_DIRS:
            (rootfs / name).mkdir(parents=True, exist_ok=True)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    image = ImageLite(
        rootfs=target / "rootfs",
        env=state["env"],
        workdir=state["workdir"],
        start_command=state["start"],
        user=state["user"],
        base=choice.note,
        build_s=time.monotonic() - started,
        uid=state["ids"][0],
        gid=state["ids"][1],
    )
    manifest = {key: value for key, value in image.__dict__.items() if key != "rootfs"}
    (building / "image.json").write_text(json.dumps(manifest, indent=1))
    os.replace(building, target)
    return image


def _apply(instruction: Instruction, rootfs: Path, context: Path, state: dict, deadline: float, log) -> None:
    keyword = instruction.keyword
    if keyword == "ENV":
        state["env"].update(env_pairs(instruction))
    elif keyword == "WORKDIR":
        state["workdir"] = _inside(instruction.arguments, state["workdir"])
        _host(rootfs, state["workdir"]).mkdir(parents=True, exist_ok=True)
    elif keyword == "RUN":
        _run(instruction, rootfs, state, deadline, log)
    elif keyword in ("COPY", "ADD"):
        _copy(instruction, rootfs, context, state)
    elif keyword == "USER":
        try:
            state["ids"] = resolve_user(rootfs, instruction.arguments, instruction.line)
        except ValueError as error:
            raise ImageBuildError(str(error)) from error
        state["user"] = instruction.arguments if state["ids"] != ROOT_IDS else None
    elif keyword in ("CMD", "ENTRYPOINT"):
        state["start_" + keyword.lower()] = instruction.shell_command
        parts = [state.get("start_entrypoint"), state.get("start_cmd")]
        text = " ".join(part for part in parts if part)
        state["start"] = text if text and text not in ("bash", "/bin/bash", "sh", "/bin/sh") else None


def _run(instruction: Instruction, rootfs: Path, state: dict, deadline: float, log) -> None:
    """One ``RUN`` in bubblewrap over the image root, its network the package registries' only (see the module
    docstring and :mod:`~tslightning.tasks.environment.build_network`)."""
    script = instruction.run_script
    env = {"PATH": BASE_ENVIRONMENT["PATH"], "HOME": "/root", "LANG": "C.UTF-8", **state["env"], **PROXY_ENV}
    argv = [
        "bwrap",
        "--bind",
        str(rootfs),
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
    ]
    bundle = trusted_bundle()
    if bundle is not None:  # inside the step's own /tmp: nothing of it lands in the image
        argv += ["--ro-bind", bundle, STEP_CA_BUNDLE]
        env.update(dict.fromkeys(CA_VARIABLES, STEP_CA_BUNDLE))
    uid, gid = state["ids"]
    if (uid, gid) != ROOT_IDS:  # as the USER: bwrap started as its host ids maps them to themselves
        argv += ["--unshare-user", "--uid", str(uid), "--gid", str(gid)]
        env["HOME"] = home_of(rootfs, uid)
    argv += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session"]
    argv += ["--chdir", state["workdir"], "--clearenv"]
    for name, value in env.items():
        argv += ["--setenv", name, value]
    argv += ["--", "/bin/sh", "-c", script]
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ImageBuildError(f"Dockerfile:{instruction.line}: the build ran past its build_timeout_sec")
    user = {"user": uid, "group": gid, "extra_groups": []} if (uid, gid) != ROOT_IDS else {}
    try:
        code, output, refused = run_step(argv, state.setdefault("allowed", allowed_hosts(rootfs)), remaining, **user)
    except subprocess.TimeoutExpired as error:
        raise ImageBuildError(f"Dockerfile:{instruction.line}: RUN ran past the build_timeout_sec") from error
    if log is not None:
        log.write(output)
    tail = output.decode("utf-8", "replace").strip()[-1500:]
    if refused:
        raise ImageBuildError(
            f"Dockerfile:{instruction.line}: needs network at build: RUN fetched from {', '.join(refused)} (only "
            f"the package registries are reachable; exit status {code}): {tail}",
            needs="needs network at build",
        )
    if code != 0:
        raise ImageBuildError(f"Dockerfile:{instruction.line}: RUN exited {code}: {tail}")


def trusted_bundle() -> str | None:
    """The CA bundle the trainer's environment names (:data:`CA_VARIABLES`), else ``None``: where the trainer
    reaches the registries through a proxy that re-signs TLS with its own CA, ``RUN`` steps trust that bundle too
    (else ``pip install`` fails certificate checks against the image's own CA store)."""
    for name in CA_VARIABLES:
        path = os.environ.get(name)
        if path and os.path.isfile(path):
            return os.path.realpath(path)
    return None


def _copy(instruction: Instruction, rootfs: Path, context: Path, state: dict) -> None:
    if "from" in instruction.flags:  # an image a wheel stands in for (environment_needs refuses any other)
        try:
            context = stage_files(instruction.flags["from"], state["images"])
        except StageError as error:
            raise ImageBuildError(f"Dockerfile:{instruction.line}: {error}", needs=error.needs) from error
    words = instruction.words()
    destination = _inside(words[-1], state["workdir"]) + ("/" if words[-1].endswith("/") else "")
    if instruction.heredocs:
        target = _host(rootfs, destination.rstrip("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(instruction.heredocs[0])
        return
    sources = [match for word in words[:-1] for match in _matches(context, word, instruction.line)]
    into_dir = destination.endswith("/") or len(sources) > 1
    for source in sources:
        target = _host(rootfs, destination.rstrip("/") or "/")
        if source.is_dir():
            shutil.copytree(source, target, symlinks=True, dirs_exist_ok=True)
        elif instruction.keyword == "ADD" and source.name.endswith(_ARCHIVES):
            target.mkdir(parents=True, exist_ok=True)
            with tarfile.open(source) as archive:
                archive.extractall(target, filter="tar")
        else:
            if into_dir or target.is_dir():
                target = target / source.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
        _ownership(instruction, target, rootfs)


def _matches(context: Path, pattern: str, line: int) -> list[Path]:
    relative = pattern.lstrip("/").removeprefix("./") or "."
    found = sorted(Path(p) for p in glob.glob(str(context / relative)))
    inside = [p for p in found if p.resolve().is_relative_to(context.resolve())]
    if not inside:
        raise ImageBuildError(f"Dockerfile:{line}: COPY source {pattern!r} is not in environment/")
    return inside


def _ownership(instruction: Instruction, target: Path, rootfs: Path) -> None:
    if "chmod" in instruction.flags:
        mode = int(instruction.flags["chmod"], 8)
        for path in [target, *target.rglob("*")] if target.is_dir() else [target]:
            path.chmod(mode)
    if "chown" in instruction.flags:
        user, _, group = instruction.flags["chown"].partition(":")
        uid = _id(rootfs / "etc/passwd", user)
        gid = _id(rootfs / "etc/group", group or user) if (group or user) else uid
        for path in [target, *target.rglob("*")] if target.is_dir() else [target]:
            os.chown(path, uid, gid, follow_symlinks=False)


def _id(table: Path, name: str) -> int:
    if name.isdigit():
        return int(name)
    for line in table.read_text().splitlines():
        fields = line.split(":")
        if fields[0] == name and len(fields) > 2 and fields[2].isdigit():
            return int(fields[2])
    return 0


def _base_root(images: Path, choice: BaseChoice, deadline: float) -> Path:
    """The cached Debian root of ``choice``, built with mmdebstrap when missing."""
    target = images / f"base-{choice.suite}-{choice.key[:16]}"
    with _locked(images, target.name):
        if (target / "rootfs" / "usr").is_dir():
            return target / "rootfs"
        building = images / f".building-{target.name}-{os.getpid()}"
        shutil.rmtree(building, ignore_errors=True)
        building.mkdir(parents=True)
        command = ["mmdebstrap", "--variant=minbase", "--quiet", f"--include={','.join(choice.packages)}"]
        command += [choice.suite, str(building / "rootfs")]
        try:
            done = subprocess.run(command, capture_output=True, timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as error:
            shutil.rmtree(building, ignore_errors=True)
            raise ImageBuildError(f"mmdebstrap {choice.suite} ran past the build_timeout_sec") from error
        if done.returncode != 0:
            shutil.rmtree(building, ignore_errors=True)
            tail = (done.stdout + done.stderr).decode("utf-8", "replace").strip()[-1500:]
            raise ImageBuildError(f"mmdebstrap {choice.suite} failed: {tail}")
        if choice.system_pip:
            for marker in (building / "rootfs" / "usr" / "lib").glob("python3*/EXTERNALLY-MANAGED"):
                marker.unlink()
        shutil.rmtree(target, ignore_errors=True)
        os.replace(building, target)
    return target / "rootfs"


class _locked:  # noqa: N801 - a context manager read as a phrase
    """An exclusive lock on ``<images>/<name>.lock`` (one builder per image across processes)."""

    def __init__(self, images: Path, name: str) -> None:
        images.mkdir(parents=True, exist_ok=True)
        self.path = images / f"{name}.lock"

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _load(directory: Path) -> ImageLite | None:
    manifest = directory / "image.json"
    if not manifest.is_file() or not (directory / "rootfs").is_dir():
        return None
    fields = json.loads(manifest.read_text())
    return ImageLite(rootfs=directory / "rootfs", **{**fields, "build_s": 0.0})


def _inside(path: str, workdir: str) -> str:
    joined = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    return os.path.normpath(joined).replace("//", "/") or "/"


def _host(rootfs: Path, inside: str) -> Path:
    """The host path of ``inside`` in ``rootfs``.

    Raises:
        ImageBuildError: a symlink the build made would lead it outside the root (an absolute link resolves on the
            host here, not in the image).
    """
    path = rootfs / inside.lstrip("/")
    existing = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), rootfs)
    if not existing.resolve().is_relative_to(rootfs.resolve()):
        raise ImageBuildError(f"{inside} leads outside the image through a symlink; write the real path instead")
    return path


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
