"""One attempt's network, shared by its live environment, its other sandboxes and its verifier, and outliving any
one of them (a live environment restarted for a multi-step task's next step finds its helpers there)."""

from __future__ import annotations

import os

import pytest

from tslightning.sandbox import AttemptDirectory, BubblewrapSandbox, LiveBubblewrapSandbox, SandboxLimits
from tslightning.sandbox.attempt_network import AttemptNetwork
from tslightning.sandbox.errors import SandboxUnavailableError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attempt's network is made by a root trainer")
FETCH = "python3 -c \"import urllib.request as u; print(u.urlopen('http://127.0.0.1:8123/hello.txt').read().decode())\""


@pytest.fixture
def network():
    shared = AttemptNetwork(61000)
    yield shared
    shared.close()


def test_sandboxes_of_one_attempt_share_its_network_and_no_other(network):
    limits = SandboxLimits(timeout_s=20)
    with AttemptDirectory() as service_dir, AttemptDirectory() as agent_dir:
        service = LiveBubblewrapSandbox(service_dir, limits=limits, unprivileged_uid=61002, verifier_uid=61003)
        service.network = network
        service.startup = ("python3 -m http.server 8123 --bind 127.0.0.1", "/app", {})
        (service_dir.app / "hello.txt").write_text("hi\n")
        service_dir.wrote_from_host()
        agent = LiveBubblewrapSandbox(agent_dir, limits=limits)
        agent.network = network
        per_command = BubblewrapSandbox(agent_dir, limits=limits)
        per_command.network = network
        try:
            service.start()
            assert os.stat(f"/proc/{service._keeper_pid}/ns/net").st_ino == network.inode()
            assert agent.run(FETCH).output == "hi\n\n"
            agent.end()  # a verifier ended the environment; the next step's first command starts it again
            assert agent.run(FETCH).output == "hi\n\n" and agent.starts == 2
            assert per_command.run(FETCH).output == "hi\n\n"  # a verifier after the environment ended, too
            alone = BubblewrapSandbox(agent_dir, limits=limits).run(FETCH + " 2>&1 | tail -1")
            assert "Connection refused" in alone.output  # another attempt: its own loopback
        finally:
            service.close()
            agent.close()
    assert not network.closed


def test_the_network_is_let_go_when_closed():
    network = AttemptNetwork(61000)
    network.close()
    network.close()  # idempotent
    assert network.closed
    with pytest.raises(RuntimeError, match="closed"):
        network.fd  # noqa: B018


def test_a_trainer_that_is_not_root_is_told_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SandboxUnavailableError, match="run it as root"):
        AttemptNetwork(61000)
