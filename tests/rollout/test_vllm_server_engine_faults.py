"""VLLMServerEngine's publication when servers die and a launcher restarts them, on fakes (no server, no Ray): a server
that dies mid-publication is dropped and reported, the others complete it; one that still answers but fails stops the
engine; with none left the engine fails; a restarted replica is checked, joins a new transfer group, receives the
version being published and serves again only once it acknowledged it."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tslightning.rollout.vllm_server.engine as server_engine
from tslightning.rollout.engine import GenerationRequest, RolloutEngineError
from tslightning.rollout.vllm_server.engine import ServedVersion, SessionRouter, VLLMServerEngine

STATE = {"weight": torch.ones(2)}


class FakeTransport:
    """Records each publication; ``fails`` raises instead (as a server that died or refused the update)."""

    def __init__(self, engine: VLLMServerEngine | None = None, server: int | None = None, fails: bool = False):
        self.published: list[int] = []
        self.closed = False
        self.fails = fails
        self.in_rotation_during_publish: bool | None = None
        self._engine, self._server = engine, server

    def publish(self, state, version: int) -> float:
        if self._engine is not None:
            self.in_rotation_during_publish = self._server in self._engine._router.alive
        if self.fails:
            raise RuntimeError("connection reset by peer")
        self.published.append(version)
        return 0.0

    def close(self) -> None:
        self.closed = True


class FakeReplicas:
    """A launcher: ``serving`` is what it reports, ``lost`` records the replicas the engine reported dead."""

    def __init__(self, serving: dict[int, tuple[int, str]]) -> None:
        self.serving_now = serving
        self.lost_replicas: list[int] = []
        self.closed = False

    def serving(self) -> dict[int, tuple[int, str]]:
        return dict(self.serving_now)

    def lost(self, index: int) -> None:
        self.lost_replicas.append(index)

    def close(self) -> None:
        self.closed = True


def _engine(urls: list[str], transports: list[FakeTransport], replicas: FakeReplicas | None) -> VLLMServerEngine:
    """An engine at version 0 over fake transports, built without its start-up checks (which need servers)."""
    engine = VLLMServerEngine.__new__(VLLMServerEngine)
    engine.urls, engine._transports, engine.replicas = list(urls), transports, replicas
    engine._policy_version, engine._failure, engine._closed, engine._publishing = 0, None, False, False
    engine._gate, engine._router = threading.Condition(), SessionRouter(len(urls))
    engine._pool, engine._timeout_s, engine._transport, engine._expected = ThreadPoolExecutor(1), 5.0, "gloo", None
    engine._generations = {i: g for i, (g, _) in replicas.serving().items()} if replicas else {}
    engine.adapter, engine._model = None, None  # merged weights; test_lora_* set an adapter
    engine.sharing = "none"  # one learner rank; test_*_follow* share the servers
    return engine


@pytest.fixture
def dead(monkeypatch):
    """URLs that do not answer /health (every other URL does)."""
    gone: set[str] = set()
    monkeypatch.setattr(server_engine, "answers", lambda url: url not in gone)
    return gone


def test_a_server_dying_mid_publication_is_dropped_and_the_others_complete_it(dead):
    replicas = FakeReplicas({0: (0, "http://a:1"), 1: (0, "http://b:1")})
    transports = [FakeTransport(fails=True), FakeTransport()]
    engine = _engine(["http://a:1", "http://b:1"], transports, replicas)
    dead.add("http://a:1")
    receipt = engine.publish(STATE, 1)
    assert (receipt.policy_version, receipt.replicas, engine.policy_version) == (1, 1, 1)
    assert transports[1].published == [1] and engine._router.alive == [1]
    assert replicas.lost_replicas == [0] and transports[0].closed  # the launcher restarts it


def test_a_server_that_answers_but_fails_the_update_stops_the_engine(dead):
    engine = _engine(["http://a:1", "http://b:1"], [FakeTransport(fails=True), FakeTransport()], None)
    with pytest.raises(RolloutEngineError, match=r"Publishing policy version 1 to http://a:1 failed"):
        engine.publish(STATE, 1)
    with pytest.raises(RolloutEngineError):  # unusable: the servers may disagree
        engine.publish(STATE, 2)


def test_with_every_server_dead_the_publication_fails_with_a_clear_error(dead):
    engine = _engine(["http://a:1"], [FakeTransport(fails=True)], FakeReplicas({0: (0, "http://a:1")}))
    dead.add("http://a:1")
    with pytest.raises(RolloutEngineError, match=r"No vLLM server acknowledged policy version 1"):
        engine.publish(STATE, 1)
    assert engine.policy_version == 0


def test_a_restarted_replica_receives_the_version_then_serves_again(dead, monkeypatch):
    replicas = FakeReplicas({0: (0, "http://a:1"), 1: (0, "http://b:1")})
    old = [FakeTransport(), FakeTransport()]
    engine = _engine(["http://a:1", "http://b:1"], old, replicas)
    engine._drop(0, server_engine.ServerGone("gone"))  # a request found it dead
    assert replicas.lost_replicas == [0] and engine._router.alive == [1]
    engine.publish(STATE, 1)  # the launcher has not restarted it yet: published to the other only
    assert old[0].published == [] and old[1].published == [1]

    joined = FakeTransport(engine, 0)
    checked: list[str] = []
    monkeypatch.setattr(server_engine, "server_problems", lambda url, expected, timeout_s: checked.append(url) or [])
    monkeypatch.setattr(server_engine.VLLMServerEngine, "_join", lambda self, url: joined)
    replicas.serving_now[0] = (1, "http://a:2/")  # generation 1, a new port
    engine.publish(STATE, 2)
    assert checked == ["http://a:2"] and engine.urls[0] == "http://a:2"
    assert joined.published == [2] and joined.in_rotation_during_publish is False  # θ_2 first, then rotation
    assert engine._router.alive == [0, 1] and old[1].published == [1, 2]
    engine.publish(STATE, 3)  # the same generation: no second join
    assert joined.published == [2, 3] and checked == ["http://a:2"]


def test_a_restarted_replica_that_serves_another_model_stops_the_engine(dead, monkeypatch):
    replicas = FakeReplicas({0: (0, "http://a:1"), 1: (0, "http://b:1")})
    engine = _engine(["http://a:1", "http://b:1"], [FakeTransport(), FakeTransport()], replicas)
    monkeypatch.setattr(server_engine, "server_problems", lambda url, expected, timeout_s: [f"{url} serves another"])
    replicas.serving_now[0] = (1, "http://a:2")
    with pytest.raises(RolloutEngineError, match=r"Restarted replica 0 cannot serve: http://a:2 serves another"):
        engine.publish(STATE, 1)


def test_a_restarted_replica_of_a_lora_run_gets_the_current_adapter_and_unloads_nothing(dead, monkeypatch, tmp_path):
    """Its base weights are θ_0's (the launcher starts it on ``policy-0`` and LoRA never changes them); it holds no
    earlier adapter, so only the servers that served θ_{k-1} unload it."""
    replicas = FakeReplicas({0: (0, "http://a:1"), 1: (0, "http://b:1")})
    engine = _engine(["http://a:1", "http://b:1"], [FakeTransport(), FakeTransport()], replicas)
    engine.adapter, engine._model, engine._policy_version = object(), "tslightning-policy-v1", 1
    calls: list[tuple] = []
    monkeypatch.setattr(server_engine, "write_adapter", lambda adapter, state, version: tmp_path / f"v{version}")
    monkeypatch.setattr(server_engine, "server_problems", lambda url, expected, timeout_s: [])
    monkeypatch.setattr(server_engine, "adapter_problems", lambda url, rank, timeout_s: [])
    monkeypatch.setattr(server_engine.VLLMServerEngine, "_join", lambda self, url: FakeTransport())
    monkeypatch.setattr(
        server_engine, "publish_adapter", lambda url, path, version, previous, t: calls.append((url, version, previous))
    )
    engine.adapter = type("Spec", (), {"r": 8})()
    replicas.serving_now[0] = (1, "http://a:2")
    engine.publish(STATE, 2)
    assert sorted(calls) == [("http://a:2", 2, None), ("http://b:1", 2, 1)]
    assert engine._router.alive == [0, 1] and engine._model == "tslightning-policy-v2"


def test_close_stops_the_launchers_replicas(dead):
    replicas = FakeReplicas({0: (0, "http://a:1")})
    engine = _engine(["http://a:1"], [FakeTransport()], replicas)
    engine.close()
    assert replicas.closed


def test_a_follower_samples_at_the_version_rank_zero_published_on_the_servers_that_acknowledged_it(dead):
    """Ranks sharing servers: rank 0's engine publishes (one server died, it is left out), another rank's follows
    what rank 0 reports serving — its requests then carry that version, go to that server only, and a replica rank 0
    readmitted (a new URL) rejoins the follower's rotation only with the publication that reached it."""
    transports = [FakeTransport(fails=True), FakeTransport()]
    publisher = _engine(["http://a:1", "http://b:1"], transports, None)
    follower = _engine(["http://a:1", "http://b:1"], [], None)
    publisher.sharing, follower.sharing = "publisher", "follower"
    assert publisher.shared_servers and follower.shared_servers
    dead.add("http://a:1")
    publisher.publish(STATE, 1)
    served = publisher.served()
    assert served == ServedVersion(1, None, {1: "http://b:1"})

    follower.follow(served)
    assert follower.policy_version == 1 and follower._router.alive == [1]
    server, version, model = follower._ticket(GenerationRequest("g0/0", (1, 2), 2, seed=0))
    assert (server, version, model) == (1, 1, None)
    follower._router.done(server)  # the request came back: nothing in flight at the next publication
    follower.follow(ServedVersion(2, "tslightning-policy-v2", {0: "http://a:2/", 1: "http://b:1"}))
    assert follower._router.alive == [0, 1] and follower.urls[0] == "http://a:2"
    assert follower._ticket(GenerationRequest("g1/0", (1, 2), 2, seed=0))[1:] == (2, "tslightning-policy-v2")
    assert transports[1].published == [1]  # the follower sent nothing itself


def test_only_the_publisher_publishes_and_only_followers_follow_increasing_versions():
    publisher = _engine(["http://a:1"], [FakeTransport()], None)
    follower = _engine(["http://a:1"], [], None)
    publisher.sharing, follower.sharing = "publisher", "follower"
    with pytest.raises(RuntimeError, match="a follower's engine does not publish"):
        follower.publish(STATE, 1)
    with pytest.raises(RuntimeError, match="follow\\(\\) is for a follower's engine"):
        publisher.follow(ServedVersion(1, None, {0: "http://a:1"}))
    with pytest.raises(ValueError, match="policy_version must increase"):
        follower.follow(ServedVersion(0, None, {0: "http://a:1"}))
