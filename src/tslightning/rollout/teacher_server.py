"""The OPD teacher as a vLLM server (``rollout.teacher_url``): frozen-teacher scoring (Eq. 8, App. D.3) over HTTP.

:class:`TeacherServer` keeps :class:`~tslightning.rollout.teacher.TeacherScorer`'s contract — ``submit(token_ids,
scored_mask)`` returns a future of the ``(|M|,)`` float32 log π_T of the scored tokens, in position order — so an
OPD source becomes ready when the server answers. Each turn is one ``POST /inference/v1/generate`` of the student's
exact token ids (token-in: never re-tokenized) asking for ``prompt_logprobs``: the server's log-probability of every
prompt token under its causal prefix, read at the scored positions. The server's continuous batching batches turns;
answers come back one by one.

A launched teacher (``rollout.ray.teacher``, :func:`~tslightning.rollout.vllm_server.ray_launcher.launch_teacher`) comes
with its launcher: a turn whose request fails to connect (or times out) reports the server lost, waits for the
launcher's restart and is resent to the restarted server — the teacher is frozen, so its scores do not change — at most
:data:`RESENDS` times; a teacher that does not come back fails the turn in one line naming the setting.

A teacher must share the student's tokenizer (token-level correspondence); it may have a larger (padded) vocabulary,
not a smaller one. :func:`teacher_problems` checks both, and the token-in route, before training starts.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tslightning.rollout.vllm_server.check import PROBE_TEXT
from tslightning.rollout.vllm_server.client import ServerClient, ServerError, ThreadClients

__all__ = ["TeacherServer", "teacher_problems"]

KEY = "rollout.teacher_url"
RESENDS = 3
"""Times a launched teacher's turn is resent after its server was restarted."""


class TeacherServer:
    """A frozen teacher served by a vLLM OpenAI-compatible server, scoring turns through prompt log-probs.

    Args:
        url: The server's base URL (``rollout.teacher_url``).
        probe_ids: The student tokenizer's ids for :data:`~tslightning.rollout.vllm_server.check.PROBE_TEXT`.
        vocab_size: The student's vocabulary size (its ``config.vocab_size``).
        context_tokens: Longest turn (history and action) the teacher must score; ``None``: not checked.
        timeout_s: Seconds one check or one scoring request may take.
        max_connections: Turns scored at once (requests in flight).
        launcher: The launched teacher's :class:`~tslightning.rollout.vllm_server.ray_launcher.RayReplicas` (one server,
            ``url`` its URL): failed requests wait for its restart and are resent; :meth:`close` stops it.

    Raises:
        ValueError: One line per problem of :func:`teacher_problems` (nothing is scored).
    """

    def __init__(
        self,
        url: str,
        probe_ids: Sequence[int],
        vocab_size: int,
        *,
        context_tokens: int | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 8,
        launcher: Any = None,
    ) -> None:
        self.url, self._launcher = url.rstrip("/"), launcher
        self._key = KEY if launcher is None else "rollout.ray.teacher"  # what error messages name
        problems = teacher_problems(self.url, probe_ids, vocab_size, min(timeout_s, 60.0), context_tokens)
        if problems:
            raise ValueError("; ".join(problems))
        self._timeout_s, self._closed = timeout_s, False
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="teacher-server")
        self._clients = ThreadClients(timeout_s)
        self._sent = itertools.count()

    def submit(self, token_ids: torch.Tensor, scored_mask: torch.Tensor) -> Future[torch.Tensor]:
        """Send one turn; resolves to ``(|M|,)`` float32 log π_T of its scored tokens, in position order.

        Args:
            token_ids: ``(T,)`` the turn's causal history and action, the student's ids.
            scored_mask: ``(T,)`` bool, True on the tokens to score; position 0 is never scored.
        """
        if self._closed:
            raise RuntimeError("TeacherServer is closed")
        if bool(scored_mask[0]):
            raise ValueError("scored_mask[0] is True: the first token has no prefix to be scored under")
        ids = [int(token) for token in token_ids.tolist()]
        positions = [int(p) for p in torch.nonzero(scored_mask, as_tuple=False).flatten().tolist()]
        return self._pool.submit(self._score, ids, positions, f"teacher-{next(self._sent)}")

    def score(self, token_ids: torch.Tensor, scored_mask: torch.Tensor) -> torch.Tensor:
        """Blocking form of :meth:`submit`."""
        return self.submit(token_ids, scored_mask).result()

    def close(self) -> None:
        """Finish the turns sent, then stop. Idempotent; the server keeps running (it is the user's) unless it was
        launched (then the launcher stops it)."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True)
            if self._launcher is not None:
                self._launcher.close()

    def __enter__(self) -> TeacherServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _score(self, ids: list[int], positions: list[int], request_id: str) -> torch.Tensor:
        import requests

        for resend in itertools.count():
            generation, url = self._server()
            server = self._clients.of(url)
            try:
                answer = server.generate(_score_body(ids, request_id))
            except ServerError as error:
                refusal = f"({error.status}): {error.text[:300]}"
                raise RuntimeError(f"{self._key} {url} refused to score a turn {refusal}") from None
            except requests.RequestException as error:
                if self._launcher is None or resend >= RESENDS:
                    failure = f"{type(error).__name__}: {error}"
                    raise RuntimeError(f"{self._key} {url} stopped answering ({failure})") from None
                self._launcher.lost(0, generation)  # a restart since this request was sent is not repeated
                continue
            return scored_prompt_logprobs(answer["prompt_logprobs"], ids, positions)
        raise AssertionError("unreachable")

    def _server(self) -> tuple[int, str]:
        """The teacher's (generation, URL) now; a launched one being restarted is waited for.

        Raises:
            RuntimeError: The launched teacher did not come back (its restart failed or took too long).
        """
        if self._launcher is None:
            return 0, self.url
        serving = self._launcher.serving().get(0)
        if serving is None:
            raise RuntimeError(
                f"rollout.ray.teacher: the launched OPD teacher stopped and did not come back "
                f"({self._launcher.error(0) or 'its restart is still under way'}); read teacher-0-*.log in "
                "rollout.ray.log_dir, or raise rollout.ray.startup_timeout_s"
            )
        self.url = serving[1]
        return serving


def scored_prompt_logprobs(entries: Sequence[Any], ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """``(len(positions),)`` float32: the log-prob vLLM reports for ``ids[p]`` at each scored position ``p``.

    Raises:
        RuntimeError: If the answer does not cover every position with its own token (another prompt was scored).
    """
    if len(entries) != len(ids):
        raise RuntimeError(f"{KEY}: the teacher scored {len(entries)} prompt tokens, the turn has {len(ids)}")
    scores = []
    for position in positions:
        entry = (entries[position] or {}).get(str(ids[position]))
        if entry is None:
            raise RuntimeError(f"{KEY}: the teacher's answer has no log-prob for token {ids[position]} at {position}")
        scores.append(float(entry["logprob"]))
    return torch.tensor(scores, dtype=torch.float32)


def teacher_problems(
    url: str, probe_ids: Sequence[int], vocab_size: int, timeout_s: float = 30.0, context_tokens: int | None = None
) -> list[str]:
    """Everything that keeps ``url`` from scoring this student's turns (empty: it can), one line each: it answers,
    its tokenizer encodes a probe as the student's does, it scores the student's highest token id, it offers the
    token-in route, and it serves ``context_tokens`` (plus the one token each scoring request generates)."""
    import requests

    server = ServerClient(url, timeout_s)
    try:
        served, tokens = server.models()[0], server.tokenize(PROBE_TEXT)
        refused = None
        try:
            server.generate(_score_body([0, vocab_size - 1], "teacher-probe"))
        except ServerError as error:
            refused = error
    except (requests.RequestException, ServerError, ValueError, KeyError, IndexError) as error:
        return [
            f"{KEY}: {url} is unreachable or not a vLLM server ({type(error).__name__}); start the teacher's vLLM "
            "server there (README: Rollout servers) or fix the URL"
        ]
    if list(tokens) != list(probe_ids):
        return [
            f"{KEY}: {url} serves a teacher with another tokenizer: it encodes a probe as {list(tokens)[:8]}..., the "
            f"student as {list(probe_ids)[:8]}...; OPD needs the student's tokenizer (token-level correspondence)"
        ]
    if refused is not None and refused.status == 404:
        return [f"{KEY}: {url} has no token-in route /inference/v1/generate: start it with --enable-scale-out"]
    if refused is not None:
        return [
            f"{KEY}: {url} cannot score the student's token id {vocab_size - 1} (its vocabulary is smaller than the "
            f"student's {vocab_size}): {refused.text[:200]}"
        ]
    if context_tokens is not None and int(served.get("max_model_len") or 0) < context_tokens + 1:
        return [
            f"{KEY}: {url} serves {served.get('max_model_len')} tokens of context, the student's turns reach "
            f"{context_tokens} (+1 generated per scoring request): start it with --max-model-len "
            f"{context_tokens + 1} or lower rollout.max_context_tokens to {int(served.get('max_model_len') or 1) - 1}"
        ]
    return []


def _score_body(ids: list[int], request_id: str) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "token_ids": ids,
        "sampling_params": {
            "max_tokens": 1,  # the prompt's log-probs are the answer; one token must still be generated
            "prompt_logprobs": 0,  # just the prompt token's own log-prob at each position
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "detokenize": False,
        },
    }
