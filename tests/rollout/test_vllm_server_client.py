"""The vLLM server client's one error policy, against a loopback stand-in: JSON answers, answers in words (vLLM's
LoRA routes), a refused route named with its status, a server that does not answer, and the reused-connection
resend of the token-in route."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from tslightning.rollout.vllm_server.client import ServerClient, ServerError


class _StandIn(BaseHTTPRequestHandler):
    generated: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            self._send(200, json.dumps({"data": [{"id": "tiny"}]}), "application/json")
        elif self.path == "/health":
            self._send(200, "")
        else:
            self._send(404, "no such route")

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        if self.path == "/v1/load_lora_adapter":
            self._send(200, "Success: LoRA adapter 'tslightning-policy-v1' added successfully.", "text/plain")
        elif self.path == "/inference/v1/generate":
            _StandIn.generated.append(body["request_id"])
            self._send(200, json.dumps({"request_id": body["request_id"]}), "application/json")
        else:
            self._send(500, "engine died")

    def _send(self, status: int, text: str, kind: str = "text/plain") -> None:
        payload = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_a_json_answer_is_returned_and_an_answer_in_words_is_not_an_error(server_url):
    client = ServerClient(server_url, timeout_s=10)
    assert client.url == server_url.rstrip("/") and client.models() == [{"id": "tiny"}]
    client.load_lora_adapter("tslightning-policy-v1", "/adapters/v1")  # 200 in words: done, nothing to parse
    assert client.health()


def test_a_refusal_names_the_method_the_url_and_the_status(server_url):
    client = ServerClient(server_url, timeout_s=10)
    with pytest.raises(ServerError, match=r"POST http://127\.0\.0\.1:\d+/pause\?mode=wait.* answered 500: engine died"):
        client.pause()
    with pytest.raises(ServerError) as refused:
        client.get("/weight_info")
    assert refused.value.status == 404 and refused.value.text == "no such route"


def test_a_server_that_does_not_answer_raises_requests_own_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = ServerClient(f"http://127.0.0.1:{port}", timeout_s=5)
    assert not client.health()
    with pytest.raises(requests.ConnectionError):
        client.models()


def test_generation_is_resent_once_on_a_reused_connection_the_server_closed(server_url, monkeypatch):
    client = ServerClient(server_url, timeout_s=10)
    post, failed = client.session.post, []

    def reset_once(url, **kwargs):
        if not failed:
            failed.append(url)
            raise requests.ConnectionError("Connection reset by peer")
        return post(url, **kwargs)

    monkeypatch.setattr(client.session, "post", reset_once)
    _StandIn.generated = []
    assert client.generate({"request_id": "u0/t0"}, resend=True) == {"request_id": "u0/t0-resent"}
    assert _StandIn.generated == ["u0/t0-resent"]  # a new id: the seed and version decide the tokens
    failed.clear()
    with pytest.raises(requests.ConnectionError):
        client.generate({"request_id": "u0/t1"})  # without resend the caller decides
