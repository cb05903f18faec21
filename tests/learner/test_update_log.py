"""One row per update on one step axis: Fabric rows merged per update, a Trainer's logger connector fed float64."""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader

from tslightning.learner.update_log import log_update_metrics, write_update_row


class Rows(Logger):
    name, version = "rows", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict]] = []

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


def test_fabric_metrics_of_one_update_make_one_row():
    rows = Rows()
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=[rows])
    log_update_metrics(fabric, None, {"a": 1.0}, step=0)
    log_update_metrics(fabric, None, {"b": torch.tensor(2.5)}, step=0)
    assert rows.rows == []  # collected until the update's row is written
    log_update_metrics(fabric, None, {"a": 3.0}, step=1)  # the next update's metrics write update 0's row
    assert rows.rows == [(0, {"a": 1.0, "b": 2.5})]
    write_update_row(fabric)
    write_update_row(fabric)  # nothing left: no empty row
    assert rows.rows == [(0, {"a": 1.0, "b": 2.5}), (1, {"a": 3.0})]


def test_under_a_trainer_metrics_reach_callback_metrics_in_float64(tmp_path):
    value = 1.0 + 2**-40  # not representable in float32

    class Logs(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            log_update_metrics(
                trainer, pl_module, {"x/value": value + batch_idx, "x/bar": 2.0}, step=batch_idx, prog_bar=["x/bar"]
            )

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (self.w - batch).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    rows = Rows()
    trainer = L.Trainer(
        max_epochs=1, accelerator="cpu", logger=rows, callbacks=[Logs()], log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(Module(), DataLoader(torch.ones(3, 1), batch_size=1))
    assert float(trainer.callback_metrics["x/value"]) == value + 2
    assert trainer.progress_bar_metrics["x/bar"] == 2.0 and "x/value" not in trainer.progress_bar_metrics
    assert [(step, row["x/value"]) for step, row in rows.rows] == [(0, value), (1, value + 1), (2, value + 2)]
