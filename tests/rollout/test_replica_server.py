"""ReplicaServer, the Ray actor's body, with a stand-in for the vLLM server (a Python process that starts a child, as
the API server starts vLLM's engine core): the URL it serves at, its log, and a stop that ends the whole group."""

from __future__ import annotations

import os
import sys
import time

import tslightning.rollout.vllm_server.ray_replica as replica_server
from tslightning.rollout.speculative import SpeculativeSettings
from tslightning.rollout.vllm_server.ray_replica import ReplicaServer

STAND_IN = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
STAND_IN += "print('serving', flush=True); time.sleep(600)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie waits only for its parent to reap it
        return stat.read().split(") ")[1][0] != "Z"


def test_the_server_starts_with_the_engine_flags_and_stops_with_its_whole_group(tmp_path, monkeypatch):
    seen = {}

    def command(model, port, **options):
        seen.update(model=model, port=port, **options)
        return [sys.executable, "-c", STAND_IN], {"VLLM_SERVER_DEV_MODE": "1"}

    monkeypatch.setattr(replica_server, "server_command", command)
    log = tmp_path / "logs" / "replica-0-0.log"
    speculative = SpeculativeSettings(method="ngram")
    server = ReplicaServer(
        "tiny", "127.0.0.1", str(log), transport="gloo", dtype="float32", max_model_len=512, speculative=speculative
    )
    url = server.start()
    assert url == f"http://127.0.0.1:{seen['port']}" and seen["model"] == "tiny" and seen["max_model_len"] == 512
    assert seen["speculative"] is speculative  # the launcher's rollout.speculative reaches the server's flags
    deadline = time.monotonic() + 60
    while "serving" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.1)
    group = [int(p) for p in os.listdir("/proc") if p.isdigit() and _group_of(int(p)) == server.pid()]
    assert len(group) == 2 and server.exit_code() is None  # the stand-in and its child
    server.stop()
    assert server.exit_code() is not None
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in group) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in group)
    server.stop()  # idempotent


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
