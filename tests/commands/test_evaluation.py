"""`tslightning validate`: pass@k of a checkpoint from real generation, real sandboxed attempts and real verifiers.

The run directory is laid out as ``fit`` leaves it: the initial policy (the untrained tiny model, which never emits a
parsable action) in ``policy-0/`` and a GPU-clock training checkpoint ``checkpoints/update-2/`` whose weights were
warm-started on two shipped tasks' reference solutions. Validating the run evaluates the checkpoint, which solves
some attempts; validating ``policy-0`` solves none. Success is the verifier's full pass, not the partial reward the
untouched environment already earns.
"""

from __future__ import annotations

import functools
import json
import shutil

import lightning as L
import pytest
import torch
import transformers
import yaml

from tslightning import cli
from tslightning.callbacks import GPUClockCheckpoint
from tslightning.callbacks.weight_publisher import publishable_state_dict
from tslightning.commands.evaluation import export_policy, resolve_checkpoint, validate
from tslightning.commands.policy_comparison import format_comparison
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.loop.warm_start import supervised_warm_start
from tslightning.models.tiny_model import load_tiny_model, save_tiny_model
from tslightning.rollout.agent_loop import AgentLimits, AgentLoop
from tslightning.tasks.demonstrations import reference_demonstration
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import library_dir

TASK_NAMES = ("count-lines", "sed-replace-text")
LIMITS = dict(max_turns=3, max_tokens_per_turn=64, max_tokens_per_trajectory=192)


def write_training_checkpoint(run, policy, lora=None):
    """``run/checkpoints/update-2`` as GPUClockCheckpoint writes it after update 2 of a fit run in ``run``."""
    module = StreamingPolicyModule(policy)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    module, _ = fabric.setup(module, module.configure_optimizers())
    module.num_optimizer_steps = module.policy_version = 3
    config = {"seed": 7, "out_dir": str(run), "model": {"lora": lora}}
    return GPUClockCheckpoint(run / "checkpoints", config=config).save(fabric, module)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """Two tasks' directory and a fit-style run directory: untrained ``policy-0/``, warm-started ``update-2``."""
    root = tmp_path_factory.mktemp("evaluation")
    for name in TASK_NAMES:
        shutil.copytree(library_dir() / name, root / "tasks" / name)
    torch.manual_seed(0)
    run = root / "run"
    model, tokenizer = load_tiny_model(save_tiny_model(run / "policy-0"))
    (run / "config.json").write_text("{}")  # fit's resolved config: not a policy checkpoint
    tasks = [TerminalTask.load(root / "tasks" / name) for name in TASK_NAMES]
    loop = AgentLoop(engine=None, tokenizer=tokenizer, limits=AgentLimits(**LIMITS))
    supervised_warm_start(model, loop, [reference_demonstration(t) for t in tasks], steps=150, seed=0)
    write_training_checkpoint(run, model)
    return root / "tasks", run


def test_trained_checkpoint_solves_tasks_the_initial_policy_cannot(run_dir, tmp_path):
    tasks, run = run_dir
    common = dict(tasks=str(tasks), split="all", attempts=3, k=[1, 3], **LIMITS)
    warm = validate(str(run), out=str(tmp_path / "warm.json"), **common)
    cold = validate(str(run / "policy-0"), **common)

    assert warm["checkpoint"]["path"] == str(run / "checkpoints" / "update-2")
    assert warm["checkpoint"]["update"] == 2 and warm["checkpoint"]["policy_version"] == 3
    assert warm["checkpoint"]["seed"] == 7 and warm["checkpoint"]["policy_hash"].startswith("sha256:")
    assert json.loads((tmp_path / "warm.json").read_text()) == warm
    for report in (warm, cold):
        assert set(report["tasks"]) == set(TASK_NAMES) and all(row["n"] == 3 for row in report["tasks"].values())
        assert 0.0 <= report["pass_at_k"]["pass@1"] <= report["pass_at_k"]["pass@3"] <= 1.0
        assert {(r["task"], r["attempt"]) for r in report["records"]} == {(t, j) for t in TASK_NAMES for j in range(3)}
        assert all(r["success"] == (r["passed_fraction"] == 1.0) for r in report["records"])
    assert any(row["c"] > 0 for row in warm["tasks"].values()) and warm["pass_at_k"]["pass@3"] > 0
    assert all(row["c"] == 0 for row in cold["tasks"].values()) and cold["pass_at_k"]["pass@3"] == 0.0
    # The untouched environment earns partial verifier credit (p = 0.25) but never counts as solved.
    assert any(0 < (r["passed_fraction"] or 0) < 1 for r in cold["records"])


def test_a_fit_run_is_compared_with_its_policy_0_on_the_train_and_dev_splits(run_dir, tmp_path, capsys):
    """No --split on a fit run: the final policy beside policy-0, train side = the run's training tasks, dev side =
    the held-out ones, with the run's own task directory, split and limits (from its config.yaml)."""
    tasks, run = run_dir
    rollout = {"tasks": str(tasks), "task_names": ["sed-replace-text"], "split": "train", "dev_fraction": 0.5}
    (run / "config.yaml").write_text(yaml.safe_dump({"rollout": rollout | LIMITS}))  # count-lines is dev at 0.5
    try:
        cli.main(["validate", "--checkpoint", str(run), "--attempts", "2", "--k", "[1,2]", "--json"])
    finally:
        (run / "config.yaml").unlink()
    report = json.loads(capsys.readouterr().out)
    rows = [(row["split"], row["policy"], list(row["per_task"])) for row in report["rows"]]
    assert rows == [
        ("train", "policy-0", ["sed-replace-text"]),
        ("train", "update-2", ["sed-replace-text"]),
        ("dev", "policy-0", ["count-lines"]),
        ("dev", "update-2", ["count-lines"]),
    ]
    initial = [row for row in report["rows"] if row["policy"] == "policy-0"]
    final = [row for row in report["rows"] if row["policy"] == "update-2"]
    assert all(row["pass_at_k"]["pass@2"] == 0.0 for row in initial)  # the untrained policy never acts
    assert sum(row["pass_at_k"]["pass@2"] for row in final) > 0
    table = format_comparison(report)
    assert "policy-0 (before RL) against the final policy, 2 attempts per task" in table
    assert table.splitlines()[-1].startswith("dev        1  update-2")


@pytest.mark.parametrize("lora", [None, {"r": 2, "alpha": 4, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}])
def test_export_serves_the_checkpointed_weights(tmp_path, lora):
    """The exported directory holds what the WeightPublisher would have served (LoRA merged)."""
    run = tmp_path / "run"
    policy, _ = load_tiny_model(save_tiny_model(run / "policy-0"))
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["target_modules"]
        )
        policy = get_peft_model(policy, config)
    with torch.no_grad():  # "trained" weights: every trainable parameter moved away from θ_0
        for parameter in policy.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.01)
    checkpoint = write_training_checkpoint(run, policy, lora)
    exported = export_policy(checkpoint, tmp_path / "exported")
    served = transformers.AutoModelForCausalLM.from_pretrained(exported, local_files_only=True).state_dict()
    expected = publishable_state_dict(policy)
    assert served.keys() == expected.keys() and all(torch.equal(served[n], expected[n]) for n in expected)
    assert (exported / "tokenizer.json").is_file()


def test_checkpoint_layouts(tmp_path):
    def policy(path):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
        (path / "model.safetensors").write_bytes(b"")
        return path

    def training_checkpoint(path):
        path.mkdir(parents=True)
        (path / "state.pt").write_bytes(b"")
        (path / "meta.json").write_text("{}")
        return path

    assert resolve_checkpoint(policy(tmp_path / "plain")) == tmp_path / "plain"
    policy(tmp_path / "nested" / "policy")
    assert resolve_checkpoint(tmp_path / "nested") == tmp_path / "nested" / "policy"
    run = tmp_path / "run"
    for version in (0, 3, 12):
        policy(run / f"policy-{version}")
    (run / "config.json").write_text("{}")  # fit's resolved config beside the policies
    (run / "policy-99").mkdir()  # no weights: not a policy
    assert resolve_checkpoint(run) == run / "policy-12"
    for update in (2, 10):
        training_checkpoint(run / "checkpoints" / f"update-{update}")
    (run / "checkpoints" / "update-11").mkdir()  # incomplete
    assert resolve_checkpoint(run) == run / "checkpoints" / "update-10"  # the latest training checkpoint wins
    assert resolve_checkpoint(run / "checkpoints") == run / "checkpoints" / "update-10"
    assert resolve_checkpoint(run / "checkpoints" / "update-2") == run / "checkpoints" / "update-2"
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no policy"):
        resolve_checkpoint(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        resolve_checkpoint(tmp_path / "missing")


def test_bad_arguments_are_reported_together_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"pass@3 needs attempts >= 3.*max_concurrent_attempts must be >= 1"):
        validate(str(tmp_path / "missing"), attempts=2, k=[1, 3], max_concurrent_attempts=0)


REPORT = {
    "pass_at_k": {"pass@1": 0.5, "pass@3": 1.0},
    "tasks": {"count-lines": {"n": 3, "c": 1, "pass@1": 1 / 3, "pass@3": 1.0}},
    "records": [],
}


def _standing_in(body):
    """``body`` with ``validate``'s signature: the CLI's options are derived from it (through ``**options``)."""
    return functools.wraps(validate)(lambda **kwargs: body(**kwargs))


def test_cli_prints_a_table_or_json(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "run_validation", _standing_in(lambda **kw: calls.append(kw) or REPORT))
    cli.main(["validate", "--checkpoint", "ckpt", "--split", "all", "--attempts", "5", "--k", "[1,3]", "--json"])
    assert json.loads(capsys.readouterr().out) == REPORT
    assert calls[0]["checkpoint"] == "ckpt" and calls[0]["attempts"] == 5 and list(calls[0]["k"]) == [1, 3]
    assert calls[0]["split"] == "all" and calls[0]["max_turns"] == 4  # fit's default limits

    cli.main(["validate", "--checkpoint", "ckpt"])
    table = capsys.readouterr().out
    assert "count-lines" in table and "33.3%" in table and "mean of 1 tasks" in table and "100.0%" in table


def test_cli_exits_2_naming_the_problem(monkeypatch, capsys):
    def refuse(**kwargs):
        raise ValueError("pass@5 needs attempts >= 5")

    monkeypatch.setattr(cli, "run_validation", _standing_in(refuse))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["validate", "--checkpoint", "ckpt", "--k", "[5]"])
    assert exit_info.value.code == 2 and "pass@5 needs attempts" in capsys.readouterr().err
