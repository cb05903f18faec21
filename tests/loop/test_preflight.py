"""`fit` checks everything before it writes a byte: a bad input leaves an earlier run byte-identical, builds no model,
and the command line prints one line naming every problem (issue 16, "The CLI loses nothing")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

import tslightning.loop.startup as startup
from tslightning import cli
from tslightning.callbacks import GradientClipping, StalenessMonitor
from tslightning.loop.fit import RolloutSettings, fit
from tslightning.loop.preflight import callback_problems, spread_group_problems
from tslightning.loop.settings import InvalidSettingsError, MissingPathError

ROOT = Path(__file__).parents[2]


def previous_run(out: Path) -> dict[str, bytes]:
    """A finished run's outputs in ``out`` (a checkpoint included); returns every file's bytes."""
    files = {
        "config.yaml": b"objective: grpo\n",
        "rewards.json": b'{"mean_rewards": [0.5]}',
        "policy-0/config.json": b"{}",
        "tiny-model/tslightning_tiny.json": b"{}",
        "checkpoints/update-0/state.pt": b"state",
        "checkpoints/update-0/meta.json": b"{}",
        "csv/version_0/metrics.csv": b"step\n0\n",
        "notes.txt": b"the user's own file",
    }
    for name, content in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(content)
    return snapshot(out)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def malformed_tasks(root: Path) -> Path:
    task = root / "broken-task"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "tests" / "test.sh").write_text("exit 0\n")
    (task / "instruction.md").write_text("Do it.\n")
    (task / "task.toml").write_text('[environment]\ncpus = "many"\n')
    return root


@pytest.fixture
def no_models(monkeypatch):
    """A check that fails must come before any model is built or loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the settings were checked")

    monkeypatch.setattr(startup, "load_tiny_model", refuse)
    monkeypatch.setattr(startup, "save_tiny_model", refuse)


BAD_INPUTS = {
    "tasks-missing": (["--rollout.tasks", "/nonexistent"], "rollout.tasks /nonexistent is not a directory"),
    "task-malformed": (
        ["--rollout.tasks", "{tasks}", "--rollout.task_names", "null", "--rollout.split", "all"],
        "task 'broken-task' ({tasks}/broken-task) is not a valid Harbor task: task.toml: [environment] cpus",
    ),
    "prompts-negative": (["--rollout.prompts_per_update", "-1"], "rollout.prompts_per_update must be >= 1; got -1"),
    "task-unknown": (["--rollout.task_names", "[no-such-task]"], "rollout.task_names ['no-such-task'] are not tasks"),
    "teacher-url-on-grpo": (
        ["--rollout.teacher_url", "http://127.0.0.1:9"],
        "rollout.teacher_url serves the OPD teacher; objective 'grpo' has none",
    ),
    "teacher-url-malformed": (
        ["--rollout.teacher_url", "localhost"],
        "rollout.teacher_url: 'localhost' is not an http://host:port URL",
    ),
    "ray-teacher-on-grpo": (
        ["--rollout.engine", "vllm_server", "--rollout.launcher", "ray", "--rollout.ray.teacher", "true"],
        "rollout.ray.teacher launches the OPD teacher; objective 'grpo' has none (remove it)",
    ),
    "ray-teacher-without-ray": (
        ["--objective", "opd", "--rollout.ray.teacher", "true"],
        "rollout.ray.teacher launches the OPD teacher with rollout.launcher ray: set rollout.launcher ray",
    ),
    "ray-teacher-and-url": (
        ["--objective", "opd", "--rollout.engine", "vllm_server", "--rollout.launcher", "ray"]
        + ["--rollout.ray.teacher", "true", "--rollout.teacher_url", "http://127.0.0.1:9"],
        "rollout.ray.teacher and rollout.teacher_url both name the OPD teacher's server",
    ),
    "ray-teacher-cpus": (
        ["--objective", "opd", "--rollout.engine", "vllm_server", "--rollout.launcher", "ray"]
        + ["--rollout.ray.teacher", "true", "--rollout.ray.teacher_num_cpus", "0"],
        "rollout.ray.teacher_num_cpus and rollout.ray.teacher_num_gpus must be >= 0 and not both 0; got 0.0, 0.0",
    ),
    "ray-teacher-and-teacher-cpus": (
        ["--objective", "opd", "--rollout.engine", "vllm_server", "--rollout.launcher", "ray"]
        + ["--rollout.ray.teacher", "true", "--model.teacher_cpus", "[0]"],
        "model.teacher_cpus places the in-process OPD teacher; rollout.ray.teacher launches it on Ray",
    ),
    "shared-servers-lora-fsdp": (
        ["--rollout.engine", "vllm_server", "--rollout.launcher", "ray", "--learner.devices", "2"]
        + ["--learner.strategy", "fsdp", "--model.lora", '{{"r": 8, "alpha": 16}}'],
        "model.lora with rollout.engine vllm_server on several ranks publishes global rank 0's adapter, which "
        "learner.strategy fsdp shards over the ranks: set learner.strategy ddp",
    ),
    "shared-servers-ray-teacher": (
        ["--objective", "opd", "--rollout.engine", "vllm_server", "--rollout.launcher", "ray"]
        + ["--rollout.ray.teacher", "true", "--learner.devices", "2"],
        "rollout.ray.teacher serves one learner rank (a restarted teacher's new URL reaches global rank 0 only): "
        "with several ranks start the teacher's vLLM server yourself and set rollout.teacher_url",
    ),
    "adapter-dir-on-hf": (
        ["--rollout.server_adapter_dir", "/shared/adapters"],
        "rollout.server_adapter_dir applies to rollout.engine vllm_server, not 'hf'",
    ),
    "resume-missing": (["--resume", "{out}/checkpoints/update-7"], "holds no state.pt"),
    "resume-no-checkpoint": (["--resume", "{out}/csv"], "holds no state.pt"),
    "float64-fsdp": (
        ["--model.precision", "64-true", "--learner.strategy", "fsdp", "--learner.devices", "2"],
        "model.precision 64-true needs learner.strategy ddp or auto: fsdp (Fabric's ModelParallelStrategy) has no",
    ),
}


def _fit_args(tmp_path: Path, out: Path, extra: list[str]) -> list[str]:
    tasks = malformed_tasks(tmp_path / "tasks")
    filled = [arg.format(out=out, tasks=tasks) for arg in extra]
    return ["fit", "--config", "configs/quickstart.yaml", "--out_dir", str(out), "--progress", "false", *filled]


@pytest.mark.parametrize("asked", [[], ["--overwrite", "true"]], ids=["plain", "overwrite"])
@pytest.mark.parametrize("bad", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_a_bad_input_leaves_the_previous_run_untouched_and_prints_one_line(tmp_path, capsys, no_models, bad, asked):
    out = tmp_path / "run"
    before = previous_run(out)
    extra, message = BAD_INPUTS[bad]
    message = message.format(tasks=tmp_path / "tasks")
    if asked and bad.startswith("resume"):
        asked = []  # overwrite and resume contradict; the bad resume alone must still leave the run as it was
    with pytest.raises(SystemExit) as exit_info:
        cli.main(_fit_args(tmp_path, out, extra + asked))
    assert exit_info.value.code == 2
    assert snapshot(out) == before  # byte-identical, and nothing new
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tslightning: ") and message in err
    assert "Traceback" not in err and "--debug" in err


@pytest.mark.parametrize("bad", ["tasks-missing", "prompts-negative", "task-unknown"])
def test_a_bad_input_with_a_valid_resume_leaves_the_run_untouched(tmp_path, capsys, no_models, bad):
    out = tmp_path / "run"
    before = previous_run(out)
    extra, message = BAD_INPUTS[bad]
    with pytest.raises(SystemExit):
        cli.main(_fit_args(tmp_path, out, extra + ["--resume", str(out / "checkpoints" / "update-0")]))
    assert snapshot(out) == before
    assert message in capsys.readouterr().err


def test_every_problem_is_reported_at_once(tmp_path, capsys, no_models):
    out = tmp_path / "run"
    previous_run(out)
    args = ["--rollout.prompts_per_update", "-1", "--rollout.task_names", "[no-such-task]", "--updates", "0"]
    args += ["--optimizer.lr", "0", "--learner.cpus", "[]", "--callbacks", "[lightning.pytorch.callbacks.Timer]"]
    with pytest.raises(SystemExit):
        cli.main(_fit_args(tmp_path, out, args))
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for field in (
        "rollout.prompts_per_update",
        "rollout.task_names",
        "updates must be >= 1",
        "optimizer.lr must be > 0",
        "learner.cpus",
        "Timer is a Trainer callback",
        f"out_dir {out} already holds a run",
    ):
        assert field in err, field


def test_a_used_out_dir_is_refused_and_overwrite_replaces_only_the_runs_outputs(tmp_path, capsys, no_models):
    out = tmp_path / "run"
    before = previous_run(out)
    with pytest.raises(SystemExit):
        cli.main(_fit_args(tmp_path, out, []))
    assert snapshot(out) == before
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--overwrite true" in err and "--resume" in err


def test_fit_raises_value_error_and_file_not_found_error_for_python_callers(tmp_path, no_models):
    with pytest.raises(InvalidSettingsError, match="rollout.prompts_per_update must be >= 1") as error:
        fit(out_dir=str(tmp_path / "a"), rollout=RolloutSettings(prompts_per_update=-1), progress=False)
    assert isinstance(error.value, ValueError) and len(error.value.problems) == 1
    with pytest.raises(MissingPathError, match="rollout.tasks /nonexistent") as error:
        fit(out_dir=str(tmp_path / "a"), rollout=RolloutSettings(tasks="/nonexistent"), progress=False)
    assert isinstance(error.value, FileNotFoundError)
    assert not (tmp_path / "a").exists()


def test_debug_shows_the_traceback_and_otherwise_one_line(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "tslightning.cli", "fit", "--config", "quickstart", "--out_dir", str(out)]
    command += ["--rollout.tasks", "/nonexistent"]
    plain = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 2 and plain.stdout == ""
    assert plain.stderr.strip().count("\n") == 0 and "rollout.tasks /nonexistent is not a directory" in plain.stderr
    debug = subprocess.run([*command, "--debug"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr
    assert "MissingPathError: rollout.tasks /nonexistent" in debug.stderr
    assert not out.exists()


def test_trainer_callbacks_are_refused_and_fabric_callbacks_kept():
    from lightning.pytorch.callbacks import LambdaCallback, ModelCheckpoint, ThroughputMonitor, Timer

    class OwnMonitor(L.Callback):
        pass

    class OwnCheckpoint(ModelCheckpoint):
        pass

    refused = [Timer(), ModelCheckpoint(), ThroughputMonitor(batch_size_fn=len), OwnCheckpoint(), GradientClipping()]
    problems = callback_problems(refused)
    assert len(problems) == len(refused)
    assert "Timer is a Trainer callback" in problems[0] and "updates" in problems[0]
    assert "ModelCheckpoint" in problems[1] and "checkpoint.interval_s" in problems[1]
    assert "ThroughputMonitor" in problems[2] and "MFUMonitor" in problems[2]
    assert "OwnCheckpoint is a Trainer callback (ModelCheckpoint" in problems[3]
    assert "GradientClipping would run twice" in problems[4] and "max_grad_norm" in problems[4]
    assert callback_problems([OwnMonitor(), StalenessMonitor(max_policy_lag=2), LambdaCallback()]) == []


def test_a_launcher_world_of_another_size_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    from tslightning.distributed.learner_strategy import LearnerSettings
    from tslightning.loop.preflight import process_group_problems

    monkeypatch.setenv("WORLD_SIZE", "3")
    assert process_group_problems(LearnerSettings(devices=2)) == [
        "learner.devices x learner.num_nodes = 2, but the launcher started 3 ranks (WORLD_SIZE): set them to what "
        "torchrun --nproc-per-node x --nnodes (or srun) starts"
    ]
    assert process_group_problems(LearnerSettings(devices=3)) == []
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        cli.main(["fit", "--config", "configs/quickstart.yaml", "--learner.devices", "2", "--out_dir", str(out)])
    assert "launcher started 3 ranks" in capsys.readouterr().err and not out.exists()


def test_a_run_that_cannot_fit_the_gpu_names_the_settings_to_change():
    from tslightning.distributed.learner_strategy import LearnerSettings
    from tslightning.loop.preflight import memory_problems
    from tslightning.loop.settings import ModelSettings, RolloutSettings

    learner = LearnerSettings(statistics_device="device")
    rollout = RolloutSettings(prompts_per_update=4, max_context_tokens=256)
    args = ("grpo", "thundersync", ModelSettings(), rollout)
    (problem,) = memory_problems(*args, learner, 4, 8, device_bytes=10 * 2**20)
    assert problem.startswith("learner: each rank needs ") and "learner.statistics_device: host" in problem
    assert memory_problems(*args, learner, 4, 8, device_bytes=2**30) == []
    assert memory_problems(*args, learner, 4, 8, device_bytes=None) == []  # a CPU learner: nothing to check


def test_auto_statistics_go_to_the_device_when_the_plan_fits_there_else_to_the_host():
    from tslightning.distributed.learner_strategy import LearnerSettings
    from tslightning.loop.learner_shape import planned_memory, policy_config
    from tslightning.loop.settings import ModelSettings, RolloutSettings

    model, rollout = ModelSettings(), RolloutSettings(prompts_per_update=4, max_context_tokens=256)
    config = policy_config(model)

    def planned(available):
        return planned_memory(config, "grpo", "thundersync", model, rollout, LearnerSettings(), 4, 8, available)

    roomy, host_only, cpu = planned(2**30), None, planned(None)
    assert roomy.statistics_device == "device" and roomy.fits
    on_device = roomy.plan.device_bytes(False)
    host_only = planned(on_device - 1)
    assert host_only.statistics_device == "host" and host_only.fits  # the statistics moved off the device
    assert host_only.plan.device_bytes(False) <= on_device - roomy.plan.statistics
    assert cpu.statistics_device == "host"  # one memory on a CPU learner: no copies


def test_shard_statistics_under_a_strategy_that_cannot_shard_them_is_refused_before_anything_is_written(
    tmp_path, capsys
):
    from tslightning.distributed.learner_strategy import LearnerSettings

    ddp = LearnerSettings(devices=2, strategy="ddp", shard_statistics=True)
    assert ddp.sharding_problems("grpo") == [
        "learner.shard_statistics shards the statistics like FSDP2's parameters; learner.strategy 'ddp' does not shard "
        "them that way: set learner.strategy: fsdp or learner.shard_statistics: false"
    ]
    fsdp = LearnerSettings(devices=2, strategy="fsdp", shard_statistics=True)
    assert fsdp.sharding_problems("grpo") == [] and "objective 'opd'" in fsdp.sharding_problems("opd")[0]
    queued = LearnerSettings(devices=2, strategy="fsdp", shard_statistics=True, fold_queue_depth=2)
    assert "set learner.fold_queue_depth: 0 with it" in queued.sharding_problems("grpo")[0]
    assert "learner.fold_queue_depth must be an int >= 0" in LearnerSettings(fold_queue_depth=-1).problems("sync")[0]
    out = tmp_path / "run"
    argv = ["fit", "--config", "configs/quickstart.yaml", "--learner.devices", "2", "--out_dir", str(out)]
    with pytest.raises(SystemExit):
        cli.main([*argv, "--learner.strategy", "deepspeed_stage_2", "--learner.shard_statistics", "true"])
    assert "learner.strategy 'deepspeed_stage_2' does not shard them" in capsys.readouterr().err and not out.exists()


def test_a_global_cap_over_spread_groups_needs_a_sample_per_rank():
    from tslightning.distributed.learner_strategy import LearnerSettings

    spread = LearnerSettings(devices=4, strategy="fsdp", shard_statistics=True)
    (problem,) = spread_group_problems("grpo", RolloutSettings(samples_per_prompt=2), spread, 1)
    assert (
        problem.startswith("group_admission_cap counts GRPO groups over all ranks")
        and "(2) must be >= the 4" in problem
    )
    assert spread_group_problems("grpo", RolloutSettings(samples_per_prompt=4), spread, 1) == []
    assert spread_group_problems("grpo", RolloutSettings(samples_per_prompt=2), spread, None) == []  # no cap to count
    whole = LearnerSettings(devices=4, strategy="fsdp")
    assert spread_group_problems("grpo", RolloutSettings(samples_per_prompt=2), whole, 1) == []  # whole groups


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_several_ranks_may_share_vllm_servers_and_only_sharded_lora_is_refused(strategy):
    from tslightning.distributed.learner_strategy import LearnerSettings
    from tslightning.loop.settings import CheckpointSettings, LoraSettings, ModelSettings, setting_problems

    rollout = RolloutSettings(engine="vllm_server", server_urls=["http://127.0.0.1:9"])
    learner = LearnerSettings(devices=2, strategy=strategy)

    def problems(model: ModelSettings) -> list[str]:
        checkpoint = CheckpointSettings()
        found = setting_problems("grpo", "thundersync", "recompute", model, rollout, learner, checkpoint, None)
        return [p for p in found if "vllm_server" in p]

    assert problems(ModelSettings()) == []  # several learner ranks on the same servers
    lora = problems(ModelSettings(lora=LoraSettings()))
    assert lora == ([] if strategy == "ddp" else [BAD_INPUTS["shared-servers-lora-fsdp"][1]])


def test_fit_on_a_gpu_prints_the_plan_and_places_the_statistics_by_it(monkeypatch, caplog):
    """What ``fit`` does on an accelerator at start, with the device faked: rank 0 prints the per-rank plan, and
    ``statistics_device: auto`` goes where the plan fits."""
    import importlib
    import logging
    from types import SimpleNamespace

    from tslightning.distributed.learner_strategy import LearnerSettings
    from tslightning.loop.settings import ModelSettings, RolloutSettings

    arguments = {
        "learner": LearnerSettings(),
        "model": ModelSettings(),
        "rollout": RolloutSettings(prompts_per_update=4, max_context_tokens=256),
        "objective": "grpo",
        "schedule": "thundersync",
        "group_admission_cap": 4,
        "sync_micro_batch_size": 8,
    }
    fit_module = importlib.import_module("tslightning.loop.fit")  # the module, not the fit function it exports
    fabric = SimpleNamespace(device=torch.device("cuda", 0))
    for memory, expected in ((2**30, "device"), (4 * 2**20, "host")):
        monkeypatch.setattr(
            torch.cuda, "get_device_properties", lambda device, memory=memory: SimpleNamespace(total_memory=memory)
        )
        caplog.clear()
        with caplog.at_level(logging.INFO):
            assert fit_module._statistics_device(fabric, arguments) == expected
        assert f"statistics on the {expected}" in caplog.text and "device peak" in caplog.text
    assert fit_module._statistics_device(SimpleNamespace(device=torch.device("cpu")), arguments) == "host"
