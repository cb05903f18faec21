"""The network of an image-lite build's ``RUN`` steps: the package registries only.

A ``RUN`` step runs in a network namespace of its own (bwrap ``--unshare-net``: its own loopback, no route out).
The one way out is an HTTP proxy at ``127.0.0.1:3128`` *inside* that namespace (``http_proxy`` / ``https_proxy``
and their upper-case forms are set, which apt, pip, uv, curl and Python's urllib honour): its listening socket is
made in the step's namespace by a thread that enters it (``setns``) and comes back, and every connection it accepts
is served from the trainer's own network. It forwards plain HTTP requests (absolute-form, as apt sends them) and
``CONNECT`` tunnels (HTTPS: pip, curl) to the allowed hosts only (:func:`allowed_hosts`); any other host gets
``403`` and is recorded, and the build then fails with ``needs network at build`` naming it.

Allowed: the hosts of the image's and the host's apt sources (``/etc/apt/sources.list``, ``sources.list.d``), of
pip's configured index (``PIP_INDEX_URL``, ``PIP_EXTRA_INDEX_URL``, ``/etc/pip.conf``), and the public registries of
:data:`~tslightning.tasks.harbor.environment_needs.REGISTRY_HOSTS`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import select
import socket
import subprocess
import threading
from collections.abc import Collection, Iterator
from pathlib import Path

from tslightning.tasks.harbor.environment_needs import REGISTRY_HOSTS

PROXY_PORT = 3128
PROXY_URL = f"http://127.0.0.1:{PROXY_PORT}"
PROXY_ENV = {name: PROXY_URL for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
"""What a ``RUN`` step's environment gets (``no_proxy`` is left unset: nothing is direct)."""
_CLONE_NEWNET = 0x40000000
_URL_HOST = re.compile(r"\b(?:https?|ftp)://(?:[^/@\s]*@)?([A-Za-z0-9.-]+|\[[0-9A-Fa-f:]+\])")
_CHUNK = 64 * 1024
_HEAD_LIMIT = 64 * 1024
_UPSTREAM_TIMEOUT_S = 30.0


def allowed_hosts(rootfs: Path | None = None) -> frozenset[str]:
    """The hosts a build step may reach (see the module docstring); ``rootfs`` adds the image's apt sources."""
    texts = [os.environ.get("PIP_INDEX_URL", ""), os.environ.get("PIP_EXTRA_INDEX_URL", "")]
    for root in (Path("/"), *([rootfs] if rootfs is not None else [])):
        for path in (root / "etc/apt/sources.list", root / "etc/pip.conf"):
            texts.append(_read(path))
        sources = root / "etc/apt/sources.list.d"
        texts += [_read(path) for path in sorted(sources.glob("*"))] if sources.is_dir() else []
    found = {match.group(1).lower() for text in texts for match in _URL_HOST.finditer(text)}
    return frozenset(found | set(REGISTRY_HOSTS))


class RegistryProxy:
    """The proxy of one build step (see the module docstring); use as a context manager around the step.

    Args:
        allowed: Host names it forwards to (exact, case-insensitive).
    """

    def __init__(self, allowed: Collection[str]) -> None:
        self.allowed = frozenset(host.lower() for host in allowed)
        self.refused: list[str] = []
        """Hosts asked for and refused, in order, once each."""
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()

    def serve_in(self, netns_path: str) -> None:
        """Listen at ``127.0.0.1:3128`` in the network namespace at ``netns_path`` and serve from now on.

        Raises:
            OSError: the namespace could not be entered, or the port not bound there.
        """
        made: dict = {}
        thread = threading.Thread(target=_listen_in, args=(netns_path, made), daemon=True)
        thread.start()
        thread.join()
        if "error" in made:
            raise made["error"]
        self._listener = made["listener"]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        """Stop accepting (tunnels open now end with the step's namespace)."""
        self._stopped.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()

    def __enter__(self) -> RegistryProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            head = _read_head(client)
            if head is None:
                return
            method, host, port, forward = _parse(head)
            if host is None:
                client.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                return
            if host not in self.allowed:
                if host not in self.refused:
                    self.refused.append(host)
                body = f"tslightning build proxy: {host} is not a package registry (needs network at build)\n"
                client.sendall(f"HTTP/1.1 403 Forbidden\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
                return
            try:
                upstream = socket.create_connection((host, port), timeout=_UPSTREAM_TIMEOUT_S)
            except OSError:
                client.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                return
            with upstream:
                upstream.settimeout(None)
                if method == "CONNECT":
                    client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                else:
                    upstream.sendall(forward)
                _relay(client, upstream)


def _listen_in(netns_path: str, made: dict) -> None:
    """In this (fresh) thread: enter the namespace, bind the proxy's port, come back."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    target = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "could not enter the build step's network namespace")
        try:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", PROXY_PORT))
            listener.listen(64)
            made["listener"] = listener
        finally:
            if libc.setns(own, _CLONE_NEWNET) != 0:  # never serve from the step's namespace
                made.pop("listener", None)
                raise OSError(ctypes.get_errno(), "could not leave the build step's network namespace")
    except OSError as error:
        made["error"] = error
    finally:
        os.close(own)
        os.close(target)


def _read_head(client: socket.socket) -> bytes | None:
    client.settimeout(_UPSTREAM_TIMEOUT_S)
    head = b""
    try:
        while b"\r\n\r\n" not in head and len(head) < _HEAD_LIMIT:
            chunk = client.recv(_CHUNK)
            if not chunk:
                return None
            head += chunk
    except OSError:
        return None
    client.settimeout(None)
    return head


def _parse(head: bytes) -> tuple[str, str | None, int, bytes]:
    """``(method, host, port, bytes to send upstream)`` of a proxy request; host None when unreadable."""
    line, _, rest = head.partition(b"\r\n")
    parts = line.decode("latin-1").split()
    if len(parts) != 3:
        return "", None, 0, b""
    method, target, version = parts
    if method == "CONNECT":
        host, _, port = target.rpartition(":")
        return method, host.strip("[]").lower() or None, int(port) if port.isdigit() else 443, b""
    match = re.fullmatch(r"http://([^/:]+)(?::(\d+))?(/.*)?", target)
    if match is None:
        return method, None, 0, b""
    origin = f"{method} {match.group(3) or '/'} {version}\r\n".encode("latin-1")
    return method, match.group(1).lower(), int(match.group(2) or 80), origin + rest


def _relay(one: socket.socket, other: socket.socket) -> None:
    """Copy both ways until either side closes."""
    for _ in _pumping(one, other):
        pass


def _pumping(one: socket.socket, other: socket.socket) -> Iterator[None]:
    peers = {one: other, other: one}
    while True:
        ready, _, _ = select.select(list(peers), [], [], _UPSTREAM_TIMEOUT_S * 10)
        if not ready:
            return
        for source in ready:
            try:
                chunk = source.recv(_CHUNK)
                if not chunk:
                    return
                peers[source].sendall(chunk)
            except OSError:
                return
        yield


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def run_step(argv: list[str], allowed: Collection[str], timeout_s: float, **popen) -> tuple[int, bytes, list[str]]:
    """Run one build step's bwrap ``argv`` (``argv[0]`` is bwrap; its environment already holds :data:`PROXY_ENV`)
    in a network namespace of its own with the proxy inside; ``(exit status, output, refused hosts)``.

    Raises:
        subprocess.TimeoutExpired: the step ran past ``timeout_s`` (it was killed).
        OSError: bwrap did not start, or the proxy could not listen in its namespace.
    """
    info_read, info_write = os.pipe()
    block_read, block_write = os.pipe()
    command = [argv[0], "--unshare-net", "--info-fd", str(info_write), "--block-fd", str(block_read), *argv[1:]]
    with RegistryProxy(allowed) as proxy:
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                pass_fds=(info_write, block_read),
                **popen,
            )
        finally:
            os.close(info_write)
            os.close(block_read)
        try:
            child = _child_pid(info_read, process)
            if child is not None:
                proxy.serve_in(f"/proc/{child}/ns/net")
            os.write(block_write, b".")
            output, _ = process.communicate(timeout=timeout_s)
        except BaseException:
            process.kill()
            process.communicate()
            raise
        finally:
            os.close(info_read)
            os.close(block_write)
    return process.returncode, output, list(proxy.refused)


def _child_pid(info_read: int, process: subprocess.Popen) -> int | None:
    """The sandbox's pid from bwrap's ``--info-fd`` JSON (None: bwrap exited first, its output says why)."""
    text = b""
    while process.poll() is None or select.select([info_read], [], [], 0)[0]:
        if select.select([info_read], [], [], 1.0)[0]:
            chunk = os.read(info_read, 4096)
            if not chunk:
                break
            text += chunk
            match = re.search(rb'"child-pid"\s*:\s*(\d+)', text)
            if match:
                return int(match.group(1))
    return None
