"""ServerTransport's publication protocol with the ``nccl`` transport (GPUs), which cannot run here: vLLM's own
trainer-side NCCL engine drives it, against a stand-in server that answers vLLM's weight-sync HTTP routes (recording
each call) and a stand-in NCCL communicator and packed broadcast (recording what is sent). The ``gloo`` transport runs
for real in test_vllm_server_engine.py and test_vllm_gloo_transfer.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
import torch

pytest.importorskip("vllm")

import vllm.distributed.weight_transfer.nccl_engine as nccl_engine  # noqa: E402

from tslightning.rollout.vllm_server.publication import ServerTransport  # noqa: E402


class StandInServer:
    """Answers vLLM's weight-sync routes on loopback; ``calls`` lists (method, path, query, body)."""

    def __init__(self, report_version: str | None = None) -> None:
        self.calls: list[tuple[str, str, dict, dict]] = []
        self.version, self.report_version = "default", report_version
        handler = self._handler()
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.http.server_port}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def _answer(self, method):
                parsed = urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else {}
                server.calls.append((method, parsed.path, parse_qs(parsed.query), body))
                if parsed.path == "/finish_weight_update" and body.get("weight_version") is not None:
                    server.version = body["weight_version"]
                answer = {"weight_version": server.report_version or server.version}
                payload = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.calls]

    def body(self, path: str) -> dict:
        return next(body for _, p, _, body in self.calls if p == path)


class StandInCommunicator:
    destroyed = False

    def destroy(self):
        self.destroyed = True


@pytest.fixture
def nccl(monkeypatch):
    """Records the rendezvous and every packed broadcast instead of running NCCL."""
    sent = {"rendezvous": [], "broadcasts": []}
    communicator = StandInCommunicator()

    def rendezvous(init_info, rank=0):
        sent["rendezvous"].append((init_info, rank))
        return communicator

    def producer(*, iterator, group, src, post_iter_func, buffer_size_bytes, num_buffers):
        assert group is communicator and src == 0
        sent["broadcasts"].append([(name, post_iter_func((name, tensor)).clone()) for name, tensor in iterator])

    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", rendezvous)
    monkeypatch.setattr(nccl_engine, "packed_nccl_broadcast_producer", producer)
    return sent, communicator


STATE = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.randn(4, dtype=torch.bfloat16)}


def test_nccl_publication_is_pause_transfer_finish_with_version_then_resume(nccl):
    sent, communicator = nccl
    server = StandInServer()
    transport = ServerTransport(server.url, "nccl", world_size=3, address="127.0.0.1", timeout_s=10)
    ((init_info, rank),) = sent["rendezvous"]
    assert (init_info.world_size, init_info.master_address, rank, init_info.packed) == (3, "127.0.0.1", 0, True)
    worker_init = server.body("/init_weight_transfer_engine")["init_info"]
    assert worker_init["rank_offset"] == 1 and worker_init["world_size"] == 3  # the server's workers follow rank 0
    assert worker_init["master_port"] == init_info.master_port and worker_init["packed"] is True

    transport.publish(STATE, 5)

    assert server.paths() == [
        "/init_weight_transfer_engine", "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
        "/weight_info", "/resume",
    ]  # fmt: skip
    pause = next(query for _, path, query, _ in server.calls if path == "/pause")
    assert pause == {"mode": ["wait"], "clear_cache": ["true"]}  # running requests finish at the old version
    assert server.body("/update_weights")["update_info"] == {
        "names": list(STATE),
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[8, 4], [4]],
    }
    assert server.body("/finish_weight_update") == {"weight_version": "5"}
    (broadcast,) = sent["broadcasts"]
    assert [name for name, _ in broadcast] == list(STATE)
    assert all(torch.equal(tensor, STATE[name]) for name, tensor in broadcast)  # the tensors themselves, streamed

    transport.close()
    assert server.paths()[-1] == "/shutdown_weight_transfer_engine" and communicator.destroyed


def test_a_server_reporting_another_version_fails_the_publication(nccl):
    server = StandInServer(report_version="4")
    transport = ServerTransport(server.url, "nccl", world_size=2, address="127.0.0.1", timeout_s=10)
    with pytest.raises(RuntimeError, match=r"finished the update but reports weight_version '4', not 5"):
        transport.publish(STATE, 5)
    assert "/resume" not in server.paths()  # left paused: nothing samples weights of an unknown version
