"""The Terminal-Bench 2 verifier template, satisfied offline from a local wheel cache, without editing the task.

Every Terminal-Bench 2 ``tests/test.sh`` installs its toolchain from the internet::

    apt-get update && apt-get install -y curl
    curl -LsSf https://astral.sh/uv/0.9.5/install.sh | sh
    source $HOME/.local/bin/env
    uvx -p 3.13 -w pytest==8.4.1 -w pytest-json-ctrf==0.3.5 pytest --ctrf /logs/verifier/ctrf.json /tests/... -rA

The toolchain directory (``toolchain/`` under :func:`default_cache_dir`) is shown read-only at
:data:`TOOLCHAIN_MOUNT` in every sandbox of an attempt (:func:`attach`), its ``bin/`` first on ``PATH`` of the
verifier's and the reference solution's commands (:func:`toolchain_env`; the agent's ``PATH`` is the image's):

- ``bin/apt-get``: ``update`` does nothing (the environment's packages are fixed offline); ``install`` succeeds when
  every named package is installed already (where no package database is shown, as on the host's system: when a
  command of its name exists) and otherwise exits 100 naming the missing ones; anything else goes to the
  environment's own ``apt-get``;
- ``bin/curl`` serves the uv installer for any ``https://astral.sh/uv/<version>/install.sh`` (to stdout, or the
  ``-o`` file) and hands every other request to the environment's own curl (no curl: exit 127 saying so);
- the installer puts ``uv`` and ``uvx`` into ``$HOME/.local/bin`` (or ``UV_INSTALL_DIR``) with the ``env`` file
  astral's installer writes, as wrappers of the cached uv binary (``uv/uv``, the ``uv`` package's own, copied);
- those wrappers run uv offline against the wheel cache (``UV_OFFLINE``, ``UV_NO_INDEX``, ``UV_FIND_LINKS`` =
  ``wheels/``, no Python downloads), and map a ``-p`` / ``--python`` version the environment lacks to its newest
  ``python3`` with one line on stderr saying so (Python builds are downloaded from GitHub, which is out of reach);
- image builds (``TSL_TOOLCHAIN_ONLINE=1``) get the same uv with the network the build has.

The wheel cache is filled at set-up time, never at run time: :func:`fill_wheel_cache` (``tslightning tasks
toolchain DIR``) downloads, with pip and its dependencies, every ``-w`` / ``--with`` / ``pip install`` pin the
tasks' test scripts name, plus :data:`DEFAULT_REQUIREMENTS`.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tslightning.sandbox import BASE_ENVIRONMENT, Sandbox

DEFAULT_PATH = BASE_ENVIRONMENT["PATH"]
TOOLCHAIN_MOUNT = "/run/tslightning/tools"
TOOLCHAIN_BIN = f"{TOOLCHAIN_MOUNT}/bin"
DEFAULT_REQUIREMENTS = ("pytest==8.4.1", "pytest-json-ctrf==0.3.5")
"""What the Terminal-Bench 2 template pins (its ``-w`` arguments)."""
TARGET_PYTHONS = ("3.11", "3.13")
"""Interpreters whose wheels are fetched: Debian bookworm's and trixie's (pure-Python wheels serve all)."""

_PIN = re.compile(
    r"(?:(?:-w|--with)[ =]|(?:uv\s+pip|pip3?|uv)\s+(?:install|add)\s+(?:-\S+\s+)*)"
    r"['\"]?([A-Za-z0-9][A-Za-z0-9._-]*(?:\[[^\]]*\])?==[A-Za-z0-9.*+!_-]+)"
)
_UNPINNED = re.compile(r"(?:-w|--with)[ =]['\"]?([A-Za-z0-9][A-Za-z0-9._-]*)(?=['\"]?(?:\s|$))")
_SCRIPT_BLOCK = re.compile(r"^# /// script\s*$\n((?:^#(?: .*)?$\n)*?)^# ///\s*$", re.M)
_SCRIPT_SUFFIXES = (".sh",)
_FETCHES = (
    re.compile(r"astral\.sh/uv[^\s|]*"),
    re.compile(r"^[^#\n]*?(?:^|[ \t;&|(])(uvx?[ \t]+(?:tool[ \t]+run|run|pip|venv|-\S+))", re.M),
)

_APT_GET = """#!/bin/sh
# tslightning offline toolchain: apt-get with fixed packages (update: nothing to do; install: already there?).
sub=""; packages=""; skip=""
for arg in "$@"; do
    if [ -n "$skip" ]; then skip=""; continue; fi
    case "$arg" in
        -o|-t|-c|--option|--target-release|--config-file) skip=1 ;;
        -*) ;;
        *) if [ -z "$sub" ]; then sub="$arg"; else packages="$packages $arg"; fi ;;
    esac
done
case "$sub" in
    update)
        echo "tsl-toolchain: apt-get update skipped (offline: this environment's packages are fixed)" >&2
        exit 0 ;;
    install)
        missing=""
        for package in $packages; do
            name="${package%%=*}"
            if [ -r /var/lib/dpkg/status ]; then
                dpkg-query -W -f='${Status}' "$name" 2>/dev/null | grep -q "install ok installed" && continue
            elif command -v "$name" >/dev/null 2>&1; then
                continue  # no package database shown (the host's system): a command of that name will do
            fi
            missing="$missing $name"
        done
        if [ -z "$missing" ]; then
            echo "tsl-toolchain: apt-get install:$packages already installed" >&2
            exit 0
        fi
        echo "E: tsl-toolchain: offline, and not installed in this environment:$missing" >&2
        exit 100 ;;
esac
IFS=:
for dir in $PATH; do
    case "$dir" in */tools/bin) continue ;; esac
    [ -x "$dir/apt-get" ] && exec "$dir/apt-get" "$@"
done
echo "apt-get: not installed here" >&2
exit 127
"""
_CURL = f"""#!/bin/sh
# tslightning offline toolchain: curl serves the uv installer from the local cache; other URLs go to the real curl.
out=""; serve=""; prev=""
for arg in "$@"; do
    case "$prev" in -o|--output) out="$arg" ;; esac
    case "$arg" in
        --output=*) out="${{arg#--output=}}" ;;
        http://astral.sh/uv/*install.sh|https://astral.sh/uv/*install.sh|https://astral.sh/uv/install.sh) serve=1 ;;
    esac
    prev="$arg"
done
if [ -n "$serve" ]; then
    if [ -n "$out" ]; then cat {TOOLCHAIN_MOUNT}/uv-install.sh > "$out"; else cat {TOOLCHAIN_MOUNT}/uv-install.sh; fi
    exit 0
fi
IFS=:
for dir in $PATH; do
    [ "$dir" = "{TOOLCHAIN_BIN}" ] && continue
    [ -x "$dir/curl" ] && exec "$dir/curl" "$@"
done
echo "curl: not installed here (tslightning's offline toolchain serves only the uv installer)" >&2
exit 127
"""
_INSTALLER = f"""#!/bin/sh
# tslightning offline toolchain: astral's uv installer, installing the cached uv (wrappers run it offline).
set -e
dir="${{UV_INSTALL_DIR:-${{XDG_BIN_HOME:-$HOME/.local/bin}}}}"
mkdir -p "$dir"
cp {TOOLCHAIN_MOUNT}/uv/wrapper "$dir/uv"
cp {TOOLCHAIN_MOUNT}/uv/wrapper "$dir/uvx"
chmod 755 "$dir/uv" "$dir/uvx"
printf '#!/bin/sh\\ncase ":${{PATH}}:" in *:"%s":*) ;; *) export PATH="%s:$PATH" ;; esac\\n' "$dir" "$dir" > "$dir/env"
echo "installing to $dir"
echo "  uv"
echo "  uvx"
echo "everything's installed!"
"""
_WRAPPER = f"""#!/bin/bash
# tslightning offline toolchain: the cached uv, offline against the local wheel cache unless a build is online.
if [ -z "$TSL_TOOLCHAIN_ONLINE" ]; then
    export UV_OFFLINE=1 UV_NO_INDEX=1 UV_FIND_LINKS={TOOLCHAIN_MOUNT}/wheels
fi
export UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1 UV_LINK_MODE=copy
have() {{ command -v "python$1" >/dev/null 2>&1; }}
newest() {{ for v in 3.14 3.13 3.12 3.11 3.10 3.9; do have "$v" && {{ echo "$v"; return; }}; done; echo 3; }}
# python3.X missing: the newest python3.Y instead (a Python build would be downloaded from GitHub, out of reach).
mapped() {{
    local version="${{1#cpython}}"; version="${{version#python}}"
    local minor; minor="$(echo "$version" | cut -d. -f1,2)"
    if [[ "$version" =~ ^3\\.[0-9]+(\\.[0-9]+)?$ ]] && ! have "$minor"; then
        echo "tsl-toolchain: Python $version is not installed here (no downloads); using python$(newest)" >&2
        echo "python$(newest)"
    else
        echo "$1"
    fi
}}
value_flags=" -w --with --from --with-requirements --with-editable -i --index-url --extra-index-url -f --find-links "
value_flags+=" --directory --project --cache-dir --constraints -c --overrides "
subcommands=" run tool venv pip install sync add compile "
args=(); rest=""
while [ $# -gt 0 ]; do
    arg="$1"; shift
    if [ -n "$rest" ]; then args+=("$arg"); continue; fi
    case "$arg" in
        --) args+=("$arg"); rest=1 ;;
        -p|--python) args+=("$arg" "$(mapped "$1")"); shift ;;
        --python=*) args+=("--python" "$(mapped "${{arg#--python=}}")") ;;
        -*) args+=("$arg")
            if [[ "$value_flags" == *" $arg "* ]] && [ $# -gt 0 ]; then args+=("$1"); shift; fi ;;
        *) args+=("$arg"); [[ "$subcommands" == *" $arg "* ]] || rest=1 ;;
    esac
done
if [ "$(basename "$0")" = uvx ]; then exec {TOOLCHAIN_MOUNT}/uv/uv tool run "${{args[@]}}"; fi
exec {TOOLCHAIN_MOUNT}/uv/uv "${{args[@]}}"
"""


@dataclass(frozen=True)
class Toolchain:
    """A prepared toolchain directory (see the module docstring); ``root`` is what the sandbox shows read-only."""

    root: Path

    @property
    def wheels(self) -> Path:
        return self.root / "wheels"

    def wheel_names(self) -> list[str]:
        return sorted(path.name for path in self.wheels.glob("*.whl"))


def default_cache_dir() -> Path:
    """Where tslightning caches toolchains and built environments: ``$TSLIGHTNING_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/tslightning``, else ``/var/cache/tslightning`` for root (whose home the sandbox's unprivileged
    uid cannot enter), else ``~/.cache/tslightning``."""
    if os.environ.get("TSLIGHTNING_CACHE_DIR"):
        return Path(os.environ["TSLIGHTNING_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "tslightning"
    if os.geteuid() == 0:
        return Path("/var/cache/tslightning")
    return Path(os.path.expanduser("~")) / ".cache" / "tslightning"


def find_toolchain(cache_dir: Path | None = None) -> Toolchain | None:
    """The toolchain prepared under ``cache_dir`` (default :func:`default_cache_dir`) with a filled wheel cache, or
    ``None`` (nothing is written)."""
    root = (cache_dir or default_cache_dir()) / "toolchain"
    toolchain = Toolchain(root)
    ready = (root / "uv" / "uv").is_file() and (root / "bin" / "apt-get").is_file() and toolchain.wheel_names()
    return toolchain if ready else None


def attach(sandbox: Sandbox, toolchain: Toolchain) -> None:
    """Show ``toolchain`` read-only at :data:`TOOLCHAIN_MOUNT` in ``sandbox``'s commands."""
    sandbox.share(toolchain.root, TOOLCHAIN_MOUNT)


def toolchain_env(sandbox: Sandbox, env: dict[str, str]) -> dict[str, str]:
    """``env`` with the toolchain's ``bin/`` first on ``PATH`` when ``sandbox`` shows the toolchain."""
    if TOOLCHAIN_MOUNT not in sandbox.shared:
        return env
    return {**env, "PATH": f"{TOOLCHAIN_BIN}:{env.get('PATH', DEFAULT_PATH)}"}


def service_env(sandbox: Sandbox, env: dict[str, str]) -> dict[str, str]:
    """``env`` of a helper service's commands where ``sandbox`` shows the toolchain: ``uv`` (its image's own, as
    ``uv run server.py`` with inline dependencies) resolves offline from the wheel cache, as the toolchain's wrappers
    make it."""
    if TOOLCHAIN_MOUNT not in sandbox.shared:
        return env
    offline = {"UV_OFFLINE": "1", "UV_NO_INDEX": "1", "UV_FIND_LINKS": f"{TOOLCHAIN_MOUNT}/wheels"}
    return {**offline, "UV_PYTHON_DOWNLOADS": "never", "UV_NO_PROGRESS": "1", "UV_LINK_MODE": "copy", **env}


def fetches_toolchain(tests: Path) -> str | None:
    """What in ``tests`` (a verifier's ``test.sh``, or a tests directory: every shell script in it, as
    ``run-tests.sh`` sources its helpers) downloads a toolchain from the internet (the uv installer, a ``uvx`` /
    ``uv`` run), else ``None``."""
    scripts = [tests] if tests.is_file() else sorted(tests.rglob("*.sh")) if tests.is_dir() else []
    texts = [script.read_text(encoding="utf-8", errors="replace") for script in scripts]
    for pattern in _FETCHES:  # the installer's URL names it best; else the first uv command
        for text in texts:
            match = pattern.search(text)
            if match:
                return match.group(match.lastindex or 0).strip()
    return None


def prepare_toolchain(cache_dir: Path | None = None) -> Toolchain:
    """The toolchain directory under ``cache_dir`` (default :func:`default_cache_dir`), written when missing or
    stale: the shims, and a copy of the ``uv`` package's binary (``pip install uv``). Idempotent; safe to call from
    several processes (files are replaced atomically).

    Raises:
        FileNotFoundError: the ``uv`` binary is not installed (the message names the fix).
    """
    root = (cache_dir or default_cache_dir()) / "toolchain"
    uv = uv_binary()
    (root / "bin").mkdir(parents=True, exist_ok=True)
    (root / "uv").mkdir(exist_ok=True)
    (root / "wheels").mkdir(exist_ok=True)
    _replace(root / "bin" / "curl", _CURL.encode(), 0o755)
    _replace(root / "bin" / "apt-get", _APT_GET.encode(), 0o755)
    _replace(root / "uv-install.sh", _INSTALLER.encode(), 0o755)
    _replace(root / "uv" / "wrapper", _WRAPPER.encode(), 0o755)
    target = root / "uv" / "uv"
    if not target.exists() or _digest(target) != _digest(uv):
        _replace(target, uv.read_bytes(), 0o755)
    return Toolchain(root)


def requirements_of(task_dirs: Iterable[Path]) -> list[str]:
    """Every package the tasks' files install with uv or pip, with :data:`DEFAULT_REQUIREMENTS`: ``name==version``
    pins in shell scripts (``-w``, ``--with``, ``pip install``, ``uv add``), unpinned ``--with NAME`` (the newest,
    fetched now), and the ``dependencies`` of inline script metadata (PEP 723: a helper's ``uv run server.py``);
    sorted, without duplicates."""
    pins = set(DEFAULT_REQUIREMENTS)
    for task_dir in task_dirs:
        for path in Path(task_dir).rglob("*"):
            if not path.is_file() or path.suffix not in (*_SCRIPT_SUFFIXES, ".py"):
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if path.suffix == ".py":
                pins.update(_script_dependencies(text))
                continue
            pins.update(_PIN.findall(text))
            pins.update(name for name in _UNPINNED.findall(text) if not any(p.startswith(f"{name}==") for p in pins))
    return sorted(pins)


def _script_dependencies(text: str) -> list[str]:
    """The ``dependencies`` of a ``# /// script`` block (PEP 723), else none."""
    match = _SCRIPT_BLOCK.search(text)
    if match is None:
        return []
    body = "\n".join(line[2:] if line.startswith("# ") else line[1:] for line in match.group(1).splitlines())
    try:
        dependencies = tomllib.loads(body).get("dependencies", [])
    except tomllib.TOMLDecodeError:
        return []
    return [str(dependency) for dependency in dependencies if isinstance(dependency, str)]


def fill_wheel_cache(toolchain: Toolchain, requirements: Iterable[str], timeout_s: float = 600.0) -> list[str]:
    """Download ``requirements`` (with their dependencies) as wheels into the cache, for each of
    :data:`TARGET_PYTHONS`, with the trainer's pip and its index settings. Returns the wheel file names now cached.

    Raises:
        RuntimeError: pip failed (its output's tail is in the message).
    """
    requirements = list(requirements)
    if all(_cached(requirement, toolchain) for requirement in requirements):
        return toolchain.wheel_names()  # nothing to download (dependencies came with the first fill)
    for version in TARGET_PYTHONS:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest"]
        command += [str(toolchain.wheels), "--python-version", version, "--implementation", "cp"]
        command += ["--platform", "manylinux_2_17_x86_64", "--platform", "any", *requirements]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"pip download {' '.join(requirements)} failed: {done.stderr.strip()[-1500:]}")
    return toolchain.wheel_names()


def _cached(requirement: str, toolchain: Toolchain) -> bool:
    """Whether a wheel of ``name==version`` (any version of an unpinned ``name``) is in the cache already (names
    compared as pip normalises them; any other specifier is fetched again)."""
    name, _, version = requirement.partition("==")
    if re.search(r"[<>=!~;]", name):
        return False
    name = re.sub(r"[-_.]+", "_", name.split("[")[0]).lower()
    return any(
        re.sub(r"[-_.]+", "_", wheel.split("-")[0]).lower() == name and (not version or wheel.split("-")[1] == version)
        for wheel in toolchain.wheel_names()
    )


def uv_binary() -> Path:
    try:
        import uv  # the `uv` package on PyPI ships the static binary

        found = Path(uv.find_uv_bin())
    except (ImportError, FileNotFoundError):
        which = shutil.which("uv")
        if which is None:
            raise FileNotFoundError(
                "the offline verifier toolchain needs the uv binary: pip install uv (it is on PyPI)"
            ) from None
        found = Path(which)
    return found.resolve()


def _replace(path: Path, content: bytes, mode: int) -> None:
    if path.exists() and path.read_bytes() == content:
        return
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_bytes(content)
    temporary.chmod(mode)
    os.replace(temporary, path)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
