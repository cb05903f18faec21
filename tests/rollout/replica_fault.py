"""A test callback for ``fit --rollout.launcher ray``: kills one replica's vLLM server (SIGKILL, its whole process
group) when update ``update`` opens, while its turns are being sampled, and at the end of training writes what the
launcher and the servers report (``replicas.json``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import lightning as L
import requests

from tslightning.callbacks.update_callback import callbacks_of
from tslightning.callbacks.weight_publisher import WeightPublisher
from tslightning.core.batch_registry import BatchPlan


class ReplicaFault(L.Callback):
    """Kills replica ``replica``'s server at the start of update ``update``.

    Args:
        path: Directory of ``replicas.json``.
        update: The update during which the server dies.
        replica: The launcher's index of the replica to kill.
    """

    def __init__(self, path: str, update: int = 1, replica: int = 0) -> None:
        self.path, self.update, self.replica = Path(path), update, replica
        self.killed: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx != self.update or not isinstance(batch, BatchPlan) or self.killed is not None:
            return
        replicas = _engine(trainer).replicas
        pid = replicas.server_pid(self.replica)
        self.killed = {"url": replicas.urls[self.replica], "pid": pid, "update": batch_idx}
        os.killpg(pid, signal.SIGKILL)

    def on_train_end(self, trainer, pl_module) -> None:
        replicas = _engine(trainer).replicas
        urls = replicas.urls
        report = {
            "killed": self.killed,
            "urls": urls,
            "serving": {str(i): list(v) for i, v in replicas.serving().items()},
            "weight_versions": [requests.get(f"{u}/weight_info", timeout=30).json()["weight_version"] for u in urls],
            "generated_tokens": [_generated_tokens(u) for u in urls],
        }
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "replicas.json").write_text(json.dumps(report))


def _engine(trainer):
    (publisher,) = [c for c in callbacks_of(trainer) if isinstance(c, WeightPublisher)]
    return publisher.engine


def _generated_tokens(url: str) -> float:
    """Tokens the server generated since it started (vLLM's ``vllm:generation_tokens_total``)."""
    lines = requests.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:generation_tokens_total"))
