"""One vLLM server replica as a process on a Ray node: the body of the launcher's Ray actor.

:class:`ReplicaServer` runs on the node Ray placed it on (with the actor's CPUs and GPUs: Ray sets
``CUDA_VISIBLE_DEVICES`` for the actor, and the server inherits it). It starts
``python -m vllm.entrypoints.openai.api_server`` with :func:`~tslightning.rollout.vllm_server.check.server_command`'s
flags on a port free on that node, in its own process group, and stops the whole group (the API server, vLLM's engine
core and workers). The server also dies with the actor's process (``PR_SET_PDEATHSIG``), so a killed actor leaves no
server behind. The class imports neither Ray nor vLLM: :mod:`tslightning.rollout.vllm_server.ray_launcher` wraps it in
``ray.remote`` and waits for its ``/health``.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from tslightning.rollout.speculative import SpeculativeSettings
from tslightning.rollout.vllm_server.check import server_command

__all__ = ["ReplicaServer"]

_STOP_TIMEOUT_S = 30
_PR_SET_PDEATHSIG = 1


class ReplicaServer:
    """A vLLM server process on this node, started with the ``vllm_server`` engine's flags.

    Args:
        model: The checkpoint the server loads (its weights are replaced by the learner's θ before it serves).
        host: The address it listens on; ``None``: this node's IP (what other nodes reach).
        log_path: Where its output goes (created on this node).
        transport: ``gloo`` or ``nccl`` (the weight-transfer backend it starts with).
        dtype: Its serving dtype.
        max_model_len: Its context length in tokens.
        extra: More ``api_server`` flags (``--kv-cache-memory-bytes``, ``--tensor-parallel-size``, ...).
        lora_rank: A LoRA run's rank: the server loads adapters at runtime (LoRA runs publish the adapter).
        speculative: ``rollout.speculative``: the server speculates with this drafter (``None``: it does not).
    """

    def __init__(
        self,
        model: str,
        host: str | None,
        log_path: str,
        *,
        transport: str,
        dtype: str,
        max_model_len: int,
        extra: Sequence[str] = (),
        lora_rank: int | None = None,
        speculative: SpeculativeSettings | None = None,
    ) -> None:
        self.model, self.host, self.log_path = model, host, Path(log_path)
        self.options = {"transport": transport, "dtype": dtype, "max_model_len": max_model_len, "extra": list(extra)}
        self.options.update(lora_rank=lora_rank, speculative=speculative)
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        """Start the server; returns its base URL (it serves once ``/health`` answers)."""
        host = self.host or _node_address()
        port = _free_port(host)
        command, environment = server_command(self.model, port, host=host, python=sys.executable, **self.options)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as output:
            self.process = subprocess.Popen(
                command,
                env={**os.environ, **environment},
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the engine core and workers stop with it
                preexec_fn=_die_with_parent,
            )
        return f"http://{host}:{port}"

    def pid(self) -> int | None:
        """The server's process id (its process group's), ``None`` before :meth:`start`."""
        return None if self.process is None else self.process.pid

    def exit_code(self) -> int | None:
        """The server's exit code, ``None`` while it runs (or before :meth:`start`)."""
        return None if self.process is None else self.process.poll()

    def log_tail(self, characters: int = 2000) -> str:
        """The end of the server's output, for error messages."""
        return self.log_path.read_text(errors="replace")[-characters:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """Stop the server's whole process group (SIGTERM, then SIGKILL). Idempotent."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(_STOP_TIMEOUT_S)
        except ProcessLookupError:  # already gone, group and all
            pass
        try:  # the engine core of a server that died on its own may still run in the group
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.poll()


def _node_address() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: die when the actor's process does (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
