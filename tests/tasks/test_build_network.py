"""RUN steps of image-lite builds reach the package registries only: a loopback server on the host that is not on
the allow list is refused (the build names it, ``needs network at build``); once allowed, it is reached through the
proxy, and never directly."""

from __future__ import annotations

import http.server
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from tslightning.tasks.environment import image_lite
from tslightning.tasks.environment.build_network import _parse, allowed_hosts
from tslightning.tasks.environment.image_lite import ImageBuildError, build_image, builder_problem, image_key
from tslightning.tasks.harbor.dockerfile import Dockerfile

CACHE = Path(tempfile.gettempdir()) / "tslightning-test-cache"
DOCKERFILE = "FROM debian:trixie-slim\nCOPY fetch.py /fetch.py\nRUN python3 /fetch.py\n"
FETCH = """\
import socket, urllib.request
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
    print("direct reached")
except OSError:
    print("direct refused")
answer = urllib.request.urlopen("http://127.0.0.1:{port}/file.txt", timeout=10).read().decode()
open("/fetched.txt", "w").write(answer)
"""


def test_allowed_hosts_are_the_configured_registries(tmp_path):
    (tmp_path / "etc/apt/sources.list.d").mkdir(parents=True)
    (tmp_path / "etc/apt/sources.list.d/debian.sources").write_text("Types: deb\nURIs: http://mirror.example.org/d\n")
    hosts = allowed_hosts(tmp_path)
    assert {"mirror.example.org", "deb.debian.org", "pypi.org", "files.pythonhosted.org"} <= hosts
    assert "127.0.0.1" not in hosts and "github.com" not in hosts


def test_proxy_requests_are_read_as_apt_and_pip_send_them():
    assert _parse(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org\r\n\r\n")[:3] == ("CONNECT", "pypi.org", 443)
    method, host, port, forward = _parse(b"GET http://Deb.Debian.org/debian/x HTTP/1.1\r\nHost: deb\r\n\r\n")
    assert (method, host, port) == ("GET", "deb.debian.org", 80)
    assert forward == b"GET /debian/x HTTP/1.1\r\nHost: deb\r\n\r\n"
    assert _parse(b"GET /relative HTTP/1.1\r\n\r\n")[1] is None


@pytest.fixture
def loopback_server(tmp_path):
    (tmp_path / "file.txt").write_text("from the loopback server\n")
    handler = lambda *args: http.server.SimpleHTTPRequestHandler(*args, directory=str(tmp_path))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def fetching_dockerfile(tmp_path, loopback_server):
    if builder_problem() is not None:
        pytest.skip(builder_problem())
    context = tmp_path / "environment"
    context.mkdir()
    (context / "Dockerfile").write_text(DOCKERFILE)
    (context / "fetch.py").write_text(FETCH.format(port=loopback_server))
    yield context / "Dockerfile"
    shutil.rmtree(CACHE / "images" / image_key(Dockerfile.read(context / "Dockerfile"), context), ignore_errors=True)


def test_a_step_fetching_from_another_host_fails_naming_it(fetching_dockerfile):
    with pytest.raises(ImageBuildError, match="Dockerfile:3: needs network at build: RUN fetched from 127.0.0.1") as e:
        build_image(fetching_dockerfile, cache_dir=CACHE)
    assert e.value.needs == "needs network at build" and "direct refused" in str(e.value)


def test_an_allowed_host_is_reached_through_the_proxy_only(fetching_dockerfile, monkeypatch):
    monkeypatch.setattr(image_lite, "allowed_hosts", lambda rootfs: frozenset({"127.0.0.1"}))
    log = tempfile.TemporaryFile()
    image = build_image(fetching_dockerfile, cache_dir=CACHE, log=log)
    log.seek(0)
    assert (image.rootfs / "fetched.txt").read_text() == "from the loopback server\n"
    assert b"direct refused" in log.read()  # the step's own loopback: the host's server is not there
