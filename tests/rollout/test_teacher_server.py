"""The OPD teacher as a vLLM server (:mod:`tslightning.rollout.teacher_server`), on the session's teacher server: its
scores equal the in-process teacher's on the same turns, an OPD ``fit`` scored by it equals the sync replay of its
recorded batches, and a teacher that is unreachable or has another tokenizer or vocabulary is refused in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tslightning.models.tiny_model import load_tiny_model
from tslightning.rollout.teacher import TeacherScorer
from tslightning.rollout.teacher_server import TeacherServer
from tslightning.rollout.vllm_server.check import PROBE_TEXT

ROOT = Path(__file__).parents[2]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # the multi-rank tests' fit runner and replay, shared
from recorded_replay import assert_float32_run_is_sync, dump_parameters, run_fit  # noqa: E402

OPD_CONFIG = ROOT / "configs" / "quickstart_opd.yaml"
UPDATES = 2
LOGPROB_TOLERANCE = 1e-4
"""float32: vLLM's CPU kernels against transformers' on the same weights."""


@pytest.fixture(scope="module")
def student(vllm_teacher_server):
    """The student's probe ids and vocabulary: the teacher server's own checkpoint (same tokenizer)."""
    policy, tokenizer = load_tiny_model(vllm_teacher_server.model_dir)
    return tuple(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"]), policy.config.vocab_size


def test_server_scores_equal_the_in_process_teachers(vllm_teacher_server, student):
    generator = torch.Generator().manual_seed(0)
    turns = []
    for length in (6, 11, 17, 40):
        ids = torch.randint(0, student[1], (length,), generator=generator)
        mask = torch.zeros(length, dtype=torch.bool)
        mask[length // 2 :] = True
        mask[length - 2] = False  # a gap: an observation token between action tokens
        turns.append((ids, mask))
    extended = torch.cat([turns[-1][0], torch.randint(0, student[1], (9,), generator=generator)])
    turns.append((extended, torch.cat([turns[-1][1], torch.ones(9, dtype=torch.bool)])))  # a later turn: shared prefix
    teacher, _ = load_tiny_model(vllm_teacher_server.model_dir)
    with TeacherServer(vllm_teacher_server.url, *student) as served, TeacherScorer(teacher) as local:
        futures = [served.submit(ids, mask) for ids, mask in turns]  # all in flight at once
        for (ids, mask), future in zip(turns, futures, strict=True):
            scores = future.result(timeout=120)
            assert scores.dtype == torch.float32 and scores.shape == (int(mask.sum()),)
            assert float((scores - local.score(ids, mask)).abs().max()) <= LOGPROB_TOLERANCE
        again = served.score(*turns[-1])  # its prefix now sits in the server's prefix cache
        assert float((again - local.score(*turns[-1])).abs().max()) <= LOGPROB_TOLERANCE


def test_an_unreachable_teacher_is_refused_in_one_line(student):
    with pytest.raises(ValueError, match="rollout.teacher_url: http://127.0.0.1:9 is unreachable") as error:
        TeacherServer("http://127.0.0.1:9", *student, timeout_s=5)
    assert "\n" not in str(error.value)


def test_a_teacher_with_another_tokenizer_is_refused(vllm_teacher_server, student):
    other = tuple(reversed(student[0]))
    with pytest.raises(ValueError, match="another tokenizer"):
        TeacherServer(vllm_teacher_server.url, other, student[1])


def test_a_teacher_with_a_smaller_vocabulary_is_refused(vllm_teacher_server, student):
    with pytest.raises(ValueError, match="vocabulary is smaller"):
        TeacherServer(vllm_teacher_server.url, student[0], student[1] + 1000)


def test_a_teacher_with_a_shorter_context_is_refused(vllm_teacher_server, student):
    with pytest.raises(ValueError, match="--max-model-len 4097 or lower rollout.max_context_tokens to 4095"):
        TeacherServer(vllm_teacher_server.url, *student, context_tokens=4096)
    TeacherServer(vllm_teacher_server.url, *student, context_tokens=4095).close()


def test_fit_refuses_an_unreachable_teacher_before_writing_anything(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable, "-m", "tslightning.cli", "fit", "--config", "configs/quickstart_opd.yaml",
        "--rollout.teacher_url", "http://127.0.0.1:9", "--out_dir", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "rollout.teacher_url: http://127.0.0.1:9 is unreachable" in done.stderr
    assert not out.exists()


def test_opd_fit_scored_by_the_server_equals_the_sync_replay(vllm_teacher_server, tmp_path):
    out = tmp_path / "run"
    run_fit(
        out, "--rollout.teacher_url", vllm_teacher_server.url, "--updates", str(UPDATES), "--warm_start.steps", "100",
        "--rollout.max_context_tokens", "4095",  # the server's 4096 hold a whole turn plus the token it generates
        "--rollout.prompts_per_update", "2", "--record_batches", "true", "--checkpoint.enabled", "false",
        *dump_parameters(out), config=OPD_CONFIG,
    )  # fmt: skip
    assert not (out / "teacher-0").exists()  # no in-process teacher was built

    fitted = torch.load(out / "theta-rank0.pt", weights_only=True)
    assert_float32_run_is_sync(fitted, out, UPDATES, config_path=OPD_CONFIG)


class _Session:
    """``requests.Session`` stand-in: a ``dead`` host refuses the connection, any other scores token ``t`` at
    position ``p`` as ``-p / 10``; every URL posted to is recorded."""

    posted: list[str] = []

    def post(self, url, json, timeout, params=None):
        import requests

        _Session.posted.append(url)
        if "dead" in url:
            raise requests.ConnectionError("connection refused")
        entries = [None] + [{str(t): {"logprob": -p / 10}} for p, t in enumerate(json["token_ids"]) if p]
        answer = {"prompt_logprobs": entries}
        return SimpleNamespace(status_code=200, json=lambda: answer, text="", content=b"{}", url=url)


class _Launcher:
    """A launched teacher whose generation ``g`` serves at ``urls[g]``; :meth:`lost` restarts the current one."""

    def __init__(self, urls: list[str]) -> None:
        self.urls, self.generation, self.lost_calls, self.closed = urls, 0, [], False

    def serving(self):
        return {0: (self.generation, self.urls[self.generation])} if self.generation < len(self.urls) else {}

    def lost(self, index, generation=None):
        self.lost_calls.append((index, generation))
        if generation == self.generation:
            self.generation += 1

    def error(self, index):
        return "ReplicaFailed: teacher 0's vLLM server exited with 1"

    def close(self):
        self.closed = True


@pytest.fixture
def fake_http(monkeypatch):
    import requests

    import tslightning.rollout.teacher_server as teacher_server

    _Session.posted = []
    monkeypatch.setattr(requests, "Session", _Session)
    monkeypatch.setattr(teacher_server, "teacher_problems", lambda *args, **kwargs: [])


TURN = torch.tensor([5, 6, 7, 8]), torch.tensor([False, True, False, True])


def test_a_launched_teacher_that_died_is_restarted_and_the_turn_resent(fake_http):
    launcher = _Launcher(["http://dead:1", "http://alive:2"])
    server = TeacherServer("http://dead:1", (1,), 9, launcher=launcher)
    assert server.score(*TURN).tolist() == pytest.approx([-0.1, -0.3])
    assert launcher.lost_calls == [(0, 0)]  # generation 0 reported lost once, then the turn went to generation 1
    assert _Session.posted == ["http://dead:1/inference/v1/generate", "http://alive:2/inference/v1/generate"]
    assert server.url == "http://alive:2"
    server.close()
    assert launcher.closed  # a launched teacher stops with its scorer


def test_a_stale_failure_does_not_restart_the_restarted_teacher(fake_http):
    launcher = _Launcher(["http://dead:1", "http://alive:2"])
    launcher.lost = lambda index, generation=None: launcher.lost_calls.append((index, generation))  # restart pending
    launcher.generation = 1  # restarted while the request to generation 0 was in flight
    server = TeacherServer("http://alive:2", (1,), 9, launcher=launcher)
    assert server.score(*TURN).tolist() == pytest.approx([-0.1, -0.3])
    assert launcher.lost_calls == []


def test_a_teacher_that_does_not_come_back_fails_the_turn_in_one_line(fake_http):
    launcher = _Launcher(["http://dead:1"])
    server = TeacherServer("http://dead:1", (1,), 9, launcher=launcher)
    with pytest.raises(
        RuntimeError, match="rollout.ray.teacher: the launched OPD teacher stopped and did not come"
    ) as error:
        server.score(*TURN)
    assert "exited with 1" in str(error.value) and "\n" not in str(error.value)


def test_resends_are_bounded_and_a_user_server_is_never_resent(fake_http):
    from tslightning.rollout.teacher_server import RESENDS

    launcher = _Launcher(["http://dead:1"] * (RESENDS + 5))
    with pytest.raises(RuntimeError, match="rollout.ray.teacher http://dead:1 stopped answering"):
        TeacherServer("http://dead:1", (1,), 9, launcher=launcher).score(*TURN)
    assert len(launcher.lost_calls) == RESENDS and len(_Session.posted) == RESENDS + 1
    _Session.posted = []
    with pytest.raises(RuntimeError, match="rollout.teacher_url http://dead:1 stopped answering"):
        TeacherServer("http://dead:1", (1,), 9).score(*TURN)
    assert len(_Session.posted) == 1
