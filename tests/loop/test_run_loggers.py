"""`fit --loggers`: Lightning loggers as class_path/init_args, their directories in out_dir by default, every bad
entry named in one line; W&B offline and an MLflow file store receive the run's metrics."""

from __future__ import annotations

import importlib.util

import lightning as L
import pytest
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from wandb_offline import history

from tslightning.loop.run_loggers import DEFAULT_LOGGERS, logger_class, logger_problems, make_loggers


def test_the_default_is_csv_and_tensorboard_in_out_dir(tmp_path):
    csv, tensorboard = make_loggers(DEFAULT_LOGGERS, tmp_path)
    assert isinstance(csv, CSVLogger) and csv.log_dir == str(tmp_path / "csv" / "version_0")
    assert isinstance(tensorboard, TensorBoardLogger) and tensorboard.log_dir == str(
        tmp_path / "tensorboard" / "version_0"
    )
    assert list(tmp_path.iterdir()) == []  # nothing is written before the first metric


def test_bare_names_and_import_paths_name_lightning_loggers():
    from lightning.pytorch.loggers import WandbLogger

    assert logger_class("WandbLogger") is WandbLogger and logger_class("CSVLogger") is CSVLogger  # Fabric's first
    assert logger_class("lightning.pytorch.loggers.CSVLogger").__module__.startswith("lightning.pytorch")


def test_every_bad_entry_is_named_with_its_fix(tmp_path):
    specs = [
        {"class_path": "NoSuchLogger"},
        {"class_path": "tslightning.loop.run_loggers.LoggerSpec"},
        {"class_path": "CSVLogger", "init_args": {"flush_every": 3}},
        {"class_path": "no.such.module.Logger"},
        {"init_args": {}},
    ]
    problems = logger_problems(specs, tmp_path)
    assert len(problems) == 5
    assert problems[0].startswith("loggers[0] NoSuchLogger: no logger class NoSuchLogger")
    assert "is not a Lightning logger" in problems[1]
    assert problems[2].startswith("loggers[2] CSVLogger:") and "flush_every" in problems[2]
    assert problems[3].startswith("loggers[3] no.such.module.Logger: No module named 'no'")
    assert problems[4] == "loggers[4] must be {class_path: ..., init_args: {...}}; got keys ['init_args']"
    if importlib.util.find_spec("mlflow") is None:
        (missing,) = logger_problems([{"class_path": "MLFlowLogger"}], tmp_path)
        assert missing == "loggers[0] MLFlowLogger: needs the mlflow package: pip install -e '.[mlflow]'"
    assert list(tmp_path.iterdir()) == []  # checking builds nothing


def test_wandb_offline_receives_the_metrics(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (logger,) = make_loggers([{"class_path": "WandbLogger", "init_args": {"offline": True}}], tmp_path)
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[logger])
    fabric.launch()  # rank 0 of one: the logger's rank_zero_only methods log (an earlier test may have left another)
    for step, reward in enumerate([0.25, 0.5, 0.75]):
        fabric.log_dict({"train/mean_reward": reward}, step=step)
    run_dir = logger.experiment.dir
    wandb.finish()
    assert run_dir.startswith(str(tmp_path / "wandb" / "offline-run-"))
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert history(run_file, "train/mean_reward") == [(0, 0.25), (1, 0.5), (2, 0.75)]


def test_mlflow_file_store_receives_the_reward_curve(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (its cachetools<8 pin, see pyproject)")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow >= 3.18 asks file-store users to say so
    (logger,) = make_loggers([{"class_path": "MLFlowLogger", "init_args": {"experiment_name": "quickstart"}}], tmp_path)
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[logger])
    for step, reward in enumerate([0.25, 0.5, 0.75]):
        fabric.log_dict({"train/mean_reward": reward}, step=step)
    logger.finalize("success")
    (curve,) = (tmp_path / "mlruns").glob(f"*/{logger.run_id}/metrics/train/mean_reward")
    assert [(float(v), int(s)) for _, v, s in (line.split() for line in curve.read_text().splitlines())] == [
        (0.25, 0),
        (0.5, 1),
        (0.75, 2),
    ]
