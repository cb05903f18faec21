"""`fit`'s start-up: the policy a fresh or resumed run starts from (no warm start on resume, the run's own policy-0
kept), the learner's cores, the engine and the teacher."""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import tslightning.loop.startup as startup
from tslightning.loop.settings import ModelSettings, RolloutSettings
from tslightning.loop.startup import learner_cores, prepare_policy
from tslightning.loop.task_selection import training_tasks
from tslightning.loop.warm_start import WarmStartSettings
from tslightning.rollout.vllm_server.ray_replica import ReplicaServer
from tslightning.tasks.validation import library_dir


@pytest.fixture
def warm_starts(monkeypatch):
    calls = []
    monkeypatch.setattr(startup, "supervised_warm_start", lambda model, *a, **kw: calls.append(model))
    return calls


def _prepare(out: Path, resume: str | None):
    rollout = RolloutSettings(task_names=["count-lines"], split="all")
    tasks = training_tasks(rollout)
    rank_zero = SimpleNamespace(global_rank=0)
    return prepare_policy(rank_zero, ModelSettings(), rollout, WarmStartSettings(steps=5), tasks, 3, out, bool(resume))


def test_a_resumed_run_skips_the_warm_start_and_keeps_its_policy_0(tmp_path, warm_starts):
    _, _, policy_dir = _prepare(tmp_path, None)
    assert len(warm_starts) == 1 and policy_dir == tmp_path / "policy-0"
    (policy_dir / "marker").write_text("written by the first run")  # stands in for its warm-started θ_0
    before = {p.name: p.read_bytes() for p in policy_dir.iterdir()}
    policy, _, resumed_dir = _prepare(tmp_path, "checkpoints/update-3")
    assert len(warm_starts) == 1  # no second warm start: the checkpoint holds the trained weights
    assert resumed_dir == policy_dir and {p.name: p.read_bytes() for p in policy_dir.iterdir()} == before
    assert all(p.grad is None for p in policy.parameters())


def test_a_resume_into_a_new_directory_saves_the_engine_a_policy(tmp_path, warm_starts):
    _, _, policy_dir = _prepare(tmp_path, "elsewhere/update-3")
    assert warm_starts == [] and (policy_dir / "config.json").is_file()


def test_learner_cores_gives_the_caller_its_cores_and_threads_back():
    """fit pins its learner; run inside a larger process (a test session), it must not leave that process pinned."""
    before = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(before[0])
    with learner_cores([core]):
        assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before
    with pytest.raises(ValueError, match="learner.cpus is empty"), learner_cores([]):
        pass


def test_the_ray_launcher_hands_its_replicas_to_the_server_engine_and_closes_them_if_it_fails(tmp_path, monkeypatch):
    import tslightning.rollout.vllm_server.engine as server_engine
    import tslightning.rollout.vllm_server.ray_launcher as replica_launcher

    launched = []

    class Replicas:
        def __init__(self, settings, model, log_dir, **options):
            self.urls, self.options, self.closed = ["http://127.0.0.1:1", "http://127.0.0.1:2"], options, False
            self.model, self.log_dir = model, log_dir
            launched.append(self)

        def close(self):
            self.closed = True

    class Engine:
        def __init__(self, urls, policy_dir, **options):
            if options["context_tokens"] == 13:
                raise ValueError("rollout.server_urls: a server serves another model")
            self.urls, self.options = urls, options

    monkeypatch.setattr(replica_launcher, "RayReplicas", Replicas)
    monkeypatch.setattr(server_engine, "VLLMServerEngine", Engine)
    rollout = RolloutSettings(engine="vllm_server", launcher="ray")
    rollout.ray.server_args = ["--seed", "0"]
    engine = startup.start_engine(rollout, tmp_path / "policy-0", "float32", max_model_len=512)
    (replicas,) = launched
    assert engine.urls == replicas.urls and engine.options["replicas"] is replicas
    assert replicas.model == tmp_path / "policy-0" and replicas.log_dir == tmp_path / "replicas"
    assert replicas.options == {
        "transport": "gloo",
        "dtype": "float32",
        "max_model_len": 512,
        "extra": ["--tensor-parallel-size", "1", "--enforce-eager"],  # the launcher appends rollout.ray.server_args
        "lora_rank": None,  # not a LoRA run: no adapters at runtime
        "speculative": None,  # rollout.speculative unset: the servers do not speculate
    }
    inspect.signature(ReplicaServer).bind(str(replicas.model), None, "log", **replicas.options)  # the actor takes them
    with pytest.raises(ValueError, match="serves another model"):
        startup.start_engine(rollout, tmp_path / "policy-0", "float32", max_model_len=13)
    assert launched[1].closed  # no replica outlives an engine that did not start


def test_the_ray_launcher_serves_the_frozen_teacher_and_stops_it_when_its_check_fails(tmp_path, monkeypatch):
    import tslightning.rollout.vllm_server.ray_launcher as replica_launcher
    from tslightning.distributed.rank_placement import RankPlacement
    from tslightning.learner.precision import serving_dtype
    from tslightning.models.tiny_model import save_tiny_model

    out = tmp_path / "run"
    save_tiny_model(out / "policy-0")
    teacher_dir = save_tiny_model(tmp_path / "teacher")
    launched = []

    class Launcher:
        def __init__(self, settings, model, log_dir, **options):
            self.settings, self.model, self.log_dir, self.options = settings, model, log_dir, options
            self.urls, self.closed = ["http://127.0.0.1:7"], False
            launched.append(self)

        def close(self):
            self.closed = True

    class Server:
        def __init__(self, url, probe_ids, vocab_size, **options):
            if options["context_tokens"] == 99:
                raise ValueError("rollout.teacher_url: http://127.0.0.1:7 serves a teacher with another tokenizer")
            self.url, self.options = url, options

    monkeypatch.setattr(replica_launcher, "launch_teacher", Launcher)
    monkeypatch.setattr(startup, "TeacherServer", Server)
    rollout = RolloutSettings(engine="vllm_server", launcher="ray", max_context_tokens=1023)
    rollout.ray.teacher, rollout.ray.teacher_num_gpus = True, 1
    model = ModelSettings(teacher_path=str(teacher_dir))

    def start():
        fabric = SimpleNamespace(global_rank=0)
        return startup.start_teacher(
            fabric, model, rollout, WarmStartSettings(), [], 0, out, False, RankPlacement(0, 1)
        )

    teacher = start()
    (launcher,) = launched
    assert teacher.url == launcher.urls[0] and teacher.options["launcher"] is launcher
    assert teacher.options["context_tokens"] == 1023
    assert (launcher.settings, launcher.model, launcher.log_dir) == (rollout.ray, teacher_dir, out / "replicas")
    utilization = str(rollout.vllm.gpu_memory_utilization)
    assert launcher.options == {
        "transport": "gloo",
        "dtype": serving_dtype(model.precision),
        "max_model_len": 1024,  # the student's whole turn plus the token each scoring request generates
        "extra": ["--tensor-parallel-size", "1", "--gpu-memory-utilization", utilization, "--enforce-eager"],
    }
    assert not (out / "teacher-0").exists()  # model.teacher_path is served, nothing built
    rollout.max_context_tokens = 99
    with pytest.raises(ValueError, match="another tokenizer"):
        start()
    assert launched[1].closed  # no teacher server outlives a check that refused it
    rollout.max_context_tokens = 4096
    with pytest.raises(
        ValueError, match=r"holds 4096 positions, scoring the student's turns needs 4097: lower rollout"
    ):
        start()
    assert len(launched) == 2  # refused before anything was launched


def test_warm_start_task_names_demonstrate_those_tasks_instead_of_the_training_tasks(tmp_path, monkeypatch):
    """The quickstart's warm start names held-out tasks too: their demonstrations are fitted, RL never sees them."""
    fitted = []
    monkeypatch.setattr(startup, "supervised_warm_start", lambda model, loop, demos, **kw: fitted.extend(demos))
    rollout = RolloutSettings(task_names=["count-lines"], split="train")
    warm_start = WarmStartSettings(steps=5, task_names=["count-lines", "compute-checksum"], near_misses=False)
    rank_zero = SimpleNamespace(global_rank=0)
    prepare_policy(rank_zero, ModelSettings(), rollout, warm_start, training_tasks(rollout), 3, tmp_path, False)
    library = {name: (library_dir() / name / "instruction.md").read_text().strip() for name in warm_start.task_names}
    assert sorted(demo.instruction for demo in fitted) == sorted(library.values())  # compute-checksum is a dev task


@pytest.mark.parametrize("precision, dtype", [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_the_in_process_teacher_scores_on_the_learners_device_in_the_serving_dtype(tmp_path, precision, dtype):
    """A GPU run's frozen teacher sits on its learner's GPU in bf16, not on the host in fp32."""
    from tslightning.distributed.rank_placement import RankPlacement
    from tslightning.models.tiny_model import save_tiny_model

    teacher_dir = save_tiny_model(tmp_path / "teacher")
    fabric = SimpleNamespace(global_rank=0, device=torch.device("cpu"))
    model = ModelSettings(teacher_path=str(teacher_dir), precision=precision)
    scorer = startup.start_teacher(
        fabric, model, RolloutSettings(), WarmStartSettings(), [], 0, tmp_path, False, RankPlacement(0, 1)
    )
    try:
        parameter = next(scorer.teacher.parameters())
        assert parameter.dtype == dtype and parameter.device == fabric.device
        scores = scorer.score(torch.tensor([1, 2, 3, 4]), torch.tensor([False, False, True, True]))
        assert scores.dtype == torch.float32 and scores.shape == (2,)
    finally:
        scorer.close()
