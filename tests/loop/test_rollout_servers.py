"""`fit`'s ``vllm_server`` engine on several learner ranks, on fakes (no server, no Ray, no process group): global rank
0 launches the servers once and publishes, the other ranks get its URLs and version by broadcast and follow; a
failure on rank 0 fails the other ranks in one line."""

from __future__ import annotations

import pytest
import torch.distributed

import tslightning.loop.rollout_servers as rollout_servers
import tslightning.rollout.vllm_server.engine as server_engine
import tslightning.rollout.vllm_server.ray_launcher as replica_launcher
from tslightning.loop.settings import RolloutSettings
from tslightning.rollout.vllm_server.engine import ServedVersion

URLS = ["http://127.0.0.1:1", "http://127.0.0.1:2"]


@pytest.fixture
def ranks(monkeypatch):
    """``ranks(r)``: this process plays learner rank ``r`` of 2; returns the launchers, engines and broadcasts."""
    seen = {"launched": [], "engines": [], "broadcast": []}

    class Replicas:
        def __init__(self, settings, model, log_dir, **options):
            self.urls = URLS
            seen["launched"].append(self)

        def close(self):
            pass

    class Engine:
        def __init__(self, urls, policy_dir, **options):
            if options["context_tokens"] == 13:
                raise ValueError("rollout.server_urls: a server serves another model")
            self.urls, self.options = list(urls), options
            seen["engines"].append(self)

        def served(self):
            return ServedVersion(0, None, dict(enumerate(self.urls)))

    def play(rank: int):
        def broadcast(value, src=0):
            seen["broadcast"].append(value)
            return value if rank == 0 else (URLS, ServedVersion(0, None, dict(enumerate(URLS))))

        monkeypatch.setattr(replica_launcher, "RayReplicas", Replicas)
        monkeypatch.setattr(server_engine, "VLLMServerEngine", Engine)
        monkeypatch.setattr(rollout_servers, "distributed", lambda: True)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda: rank)
        monkeypatch.setattr(rollout_servers, "control_broadcast", broadcast)
        return seen

    return play


def _start(tmp_path, context: int = 512):
    rollout = RolloutSettings(engine="vllm_server", launcher="ray")
    return rollout_servers.start_vllm_server(rollout, tmp_path / "policy-0", "float32", context)


def test_rank_zero_launches_the_servers_once_publishes_and_broadcasts_their_urls(ranks, tmp_path):
    seen = ranks(0)
    engine = _start(tmp_path)
    assert len(seen["launched"]) == 1 and engine.options["sharing"] == "publisher"
    assert engine.options["replicas"] is seen["launched"][0]
    assert seen["broadcast"] == [(URLS, ServedVersion(0, None, {0: URLS[0], 1: URLS[1]}))]


def test_another_rank_launches_nothing_and_follows_rank_zeros_servers(ranks, tmp_path):
    seen = ranks(1)
    engine = _start(tmp_path)
    assert seen["launched"] == [] and seen["broadcast"] == [None]  # once is once: rank 0's launch only
    assert engine.urls == URLS and "replicas" not in engine.options
    assert (engine.options["sharing"], engine.options["rank"], engine.options["policy_version"]) == ("follower", 1, 0)


def test_a_failure_on_rank_zero_is_raised_there_and_broadcast_to_the_others(ranks, tmp_path, monkeypatch):
    seen = ranks(0)
    with pytest.raises(ValueError, match="serves another model"):
        _start(tmp_path, context=13)
    assert seen["broadcast"] == ["ValueError: rollout.server_urls: a server serves another model"]
    monkeypatch.setattr(rollout_servers, "control_broadcast", lambda value, src=0: seen["broadcast"][0])
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    with pytest.raises(ValueError, match=r"global rank 0 could not start the vllm_server engine \(ValueError: "):
        _start(tmp_path)
