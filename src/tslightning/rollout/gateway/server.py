"""The OpenAI-compatible gateway between an agent harness and the rollout engine, at zero staleness.

A harness talks to it as to any OpenAI-compatible server — ``POST /v1/chat/completions``, ``POST /v1/completions``,
``GET /v1/models`` — with its attempt's key (:mod:`~tslightning.rollout.gateway.attempt_sessions`). Each call is
one turn of its attempt's trajectory: the gateway renders the messages with the policy's chat template, keeps the
ids already sampled and tokenizes only what is new (:mod:`~tslightning.rollout.gateway.conversation`), and sends
the prompt ids to the rollout engine token-in/token-out (one :class:`~tslightning.rollout.engine.GenerationRequest`,
seeded by run, update, task, trajectory and turn as the built-in loop's). The reply's sampled ids, their log-probs
and their policy version become the turn (:mod:`~tslightning.rollout.gateway.trajectory`).

**Zero staleness.** An attempt opened for update k samples every call at θ_k: a call waits while the engine serves
an older version (θ_k is being published: nothing fails, it is answered once every replica acknowledged θ_k), is
refused if the engine serves a newer one, and an answer stamped with any other version fails the attempt (its
rollout fails; nothing of it reaches the learner). Publication never overlaps a zero-staleness update's calls: an
update's attempts all close before its barrier, and the ``vllm_server`` engine additionally holds requests submitted
during a publication.

**Commands.** ``POST /tslightning/v1/commands`` (same key) runs one command in the attempt's live sandbox
(``TaskAttempt.run_command``: the task's limits, Table 6's 120 s, output head and tail kept) and answers its output and
exit code; harnesses that execute commands themselves use it through an adapter (mini-swe-agent:
:mod:`~tslightning.rollout.harness.programs.mini_swe_agent_environment`).

One gateway serves one learner rank: it forwards to that rank's engine, its attempts are that rank's share, and it
listens on loopback at a port the OS picks (``port=0``), so ranks on a node never collide.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from aiohttp import web

from tslightning.rollout.agent_loop import AgentLimits, TaskAttempt
from tslightning.rollout.engine import RolloutEngine
from tslightning.rollout.gateway.attempt_log import AttemptLog
from tslightning.rollout.gateway.attempt_sessions import AttemptSession, AttemptSessions, TurnListener
from tslightning.rollout.gateway.conversation import ChatTokens
from tslightning.rollout.gateway.errors import GatewayError
from tslightning.rollout.gateway.schema import (
    Answer,
    CallRequest,
    parse_chat,
    parse_completion,
    response_body,
    stream_events,
)
from tslightning.rollout.gateway.trajectory import HarnessTrajectory

__all__ = ["OpenAIGateway"]

VERSION_POLL_S = 0.01
"""How often a call waiting for its policy version checks the engine again."""
MAX_BODY_BYTES = 256 * 2**20
"""Largest request body (a long conversation as text)."""


class OpenAIGateway:
    """An OpenAI-compatible server in front of one rollout engine, on its own event-loop thread.

    Args:
        engine: This rank's rollout engine (any :class:`~tslightning.rollout.engine.RolloutEngine`).
        tokenizer: The policy's tokenizer and chat template.
        limits: Per-attempt limits (Table 6) and the sampling temperature.
        run_seed: The run seed the turns' sampling seeds derive from.
        model_name: The model id harnesses name (``/v1/models`` lists it; a call naming another is refused).
        host: Where to listen; loopback by default (harnesses run on this host).
        port: The port; 0 lets the OS pick a free one (:attr:`url` tells which).
        allow_segments: A rewritten history opens a segment (scored under its own context; the default); ``False``:
            the call is refused and the attempt ends.
        max_concurrent_commands: Sandbox commands running at once, over all attempts.
        version_wait_s: Longest a call waits for its policy version to be published.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        limits: AgentLimits,
        run_seed: int = 0,
        *,
        model_name: str = "tslightning-policy",
        host: str = "127.0.0.1",
        port: int = 0,
        allow_segments: bool = True,
        max_concurrent_commands: int = 16,
        version_wait_s: float = 3600.0,
    ) -> None:
        self.engine, self.limits, self.run_seed = engine, limits, run_seed
        self.chat = ChatTokens(tokenizer)
        self.model_name, self.allow_segments, self.version_wait_s = model_name, allow_segments, version_wait_s
        self.sessions = AttemptSessions()
        self._address = (host, port)
        self._tools = ThreadPoolExecutor(max_concurrent_commands, thread_name_prefix="gateway-command")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="openai-gateway", daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""
        """``http://host:port`` once started."""

    # ---------------------------------------------------------------- lifecycle
    def start(self, timeout_s: float = 30.0) -> OpenAIGateway:
        """Listen (returns once the socket is bound; a port that cannot be bound raises, leaving nothing running)."""
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop listening (later calls find no server) and stop the gateway's thread. Idempotent."""
        if self._thread.is_alive():
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout_s)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout_s)
            if not self._thread.is_alive():
                self._loop.close()
        self._tools.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> OpenAIGateway:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def base_url(self) -> str:
        """What a harness sets as its OpenAI base URL: ``http://host:port/v1``."""
        return f"{self.url}/v1"

    # ---------------------------------------------------------------- attempts (called from the rollout's threads)
    def open_attempt(
        self,
        task_id: str,
        group_id: str,
        trajectory_index: int,
        update: int,
        attempt: TaskAttempt | None = None,
        listener: TurnListener | None = None,
        log_dir: Path | None = None,
        policy_version: int | None = None,
    ) -> AttemptSession:
        """Open an attempt whose calls are sampled at ``policy_version`` (default: the version the engine serves
        now, which is update ``update``'s under the zero-staleness schedules); its key names it in calls."""
        version = self.engine.policy_version if policy_version is None else policy_version
        trajectory = HarnessTrajectory(task_id, group_id, trajectory_index, update, ())
        return self.sessions.open(
            lambda key: AttemptSession(
                key,
                trajectory,
                version,
                self.limits,
                self.run_seed,
                attempt,
                self.allow_segments,
                listener,
                AttemptLog(log_dir),
            )
        )

    def close_attempt(self, session: AttemptSession, timeout_s: float = 600.0) -> HarnessTrajectory:
        """Close ``session`` once its call in flight (if any) is answered; later calls get ``attempt_closed``.
        Returns its trajectory (call from any thread but the gateway's)."""
        return asyncio.run_coroutine_threadsafe(self._close(session), self._loop).result(timeout_s)

    async def _close(self, session: AttemptSession) -> HarnessTrajectory:
        async with session.call_lock, session.command_lock:
            session.closed = True
        self.sessions.forget(session)
        return session.trajectory

    # ---------------------------------------------------------------- HTTP
    async def _serve(self) -> None:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        for prefix in ("", "/attempts/{key}"):
            app.router.add_get(prefix + "/v1/models", self._models)
            app.router.add_post(prefix + "/v1/chat/completions", self._chat_completions)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_post(prefix + "/tslightning/v1/commands", self._command)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, *self._address)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "policy_version": self.engine.policy_version})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "tslightning"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._call(request, chat=False)

    async def _call(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            session = self.sessions.get(_key(request))
            body = await _json(request)
            parse = parse_chat if chat else parse_completion
            call = parse(body, self.limits.temperature)
            if body.get("model") not in (None, self.model_name):
                raise GatewayError(
                    404, "model_not_found", f"model {body['model']!r} is not served here; use {self.model_name!r}"
                )
            if call.logprobs and getattr(self.engine, "speculative", None) is not None:
                raise GatewayError(
                    400,
                    "invalid_value",
                    "logprobs are not served: this run samples with speculative decoding (rollout.speculative), whose "
                    "reported log-probs are not the sampling distribution's; ask without logprobs",
                    "logprobs",
                )
            async with session.call_lock:
                answer = await self._turn(session, call)
        except GatewayError as error:
            return web.json_response(error.body(), status=error.status)
        if not call.stream:
            return web.json_response(response_body(answer, chat, call.logprobs))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for event in stream_events(answer, chat, call.logprobs, call.include_usage):
            await response.write(event)
        await response.write_eof()
        return response

    async def _turn(self, session: AttemptSession, call: CallRequest) -> Answer:
        """Sample one turn of ``session`` at its policy version and record it."""
        prompt = self.chat.render(call.prompt) if call.chat else call.prompt
        vocabulary = len(self.chat.tokenizer)
        if not isinstance(prompt, str) and not all(0 <= t < vocabulary for t in prompt):
            raise GatewayError(400, "invalid_value", f"prompt ids must lie in [0, {vocabulary})", "prompt")
        request = session.plan_turn(self.chat, prompt, call.max_tokens)
        await self._wait_for_version(session)
        start = time.perf_counter()
        try:
            generation = await asyncio.wrap_future(self.engine.submit(request))
        except ValueError as error:  # the engine refused the request as asked (nothing was sampled)
            raise GatewayError(400, "invalid_request", str(error)) from error
        except Exception as error:  # the engine failed: the attempt, and with it the rollout, must fail
            session.failure = f"the rollout engine failed a call of attempt {session.label}: {error}"
            raise GatewayError(500, "engine_error", session.failure) from error
        if generation.policy_version != session.policy_version:
            session.failure = (
                f"a call of attempt {session.label} was sampled at version {generation.policy_version}, not the "
                f"attempt's {session.policy_version}: refusing tokens of another policy"
            )
            raise GatewayError(500, "policy_version_mismatch", session.failure)
        turn, content, text = session.record(self.chat, generation, time.perf_counter() - start)
        return Answer(
            call_id=f"call-{request.request_id}",
            model=self.model_name,
            text=content if call.chat else text,
            token_ids=generation.token_ids,
            logprobs=generation.logprobs,
            token_texts=tuple(self.chat.tokenizer.decode([t]) for t in generation.token_ids) if call.logprobs else (),
            finish_reason=generation.finish_reason,
            prompt_tokens=len(request.prompt_token_ids),
            policy_version=generation.policy_version,
            turn=turn.index,
            segment=session.trajectory.segments - 1,
        )

    async def _wait_for_version(self, session: AttemptSession) -> None:
        """Hold the call while θ_k is being published; refuse it once the engine moved past θ_k."""
        deadline = time.monotonic() + self.version_wait_s
        while self.engine.policy_version < session.policy_version:
            if time.monotonic() > deadline:
                raise GatewayError(
                    503, "policy_not_published", f"policy version {session.policy_version} was not published in time"
                )
            await asyncio.sleep(VERSION_POLL_S)
        if self.engine.policy_version > session.policy_version:
            session.end_reason = "stale"
            raise GatewayError(
                403,
                "attempt_stale",
                f"attempt {session.label} samples at version {session.policy_version}, but the engine already serves "
                f"{self.engine.policy_version}: it takes no more calls",
            )

    async def _command(self, request: web.Request) -> web.Response:
        try:
            session = self.sessions.get(_key(request))
            body = await _json(request)
            command = body.get("command")
            if not isinstance(command, str):
                raise GatewayError(400, "invalid_value", "command must be a string", "command")
            if session.attempt is None:
                raise GatewayError(404, "no_environment", f"attempt {session.label} has no environment to run in")
            async with session.command_lock:
                if session.closed:
                    raise GatewayError(403, "attempt_closed", f"attempt {session.label} is closed")
                start = time.perf_counter()
                outcome = await self._loop.run_in_executor(self._tools, session.attempt.run_command, command)
                session.commands += 1
                session.log.command(command, outcome, time.perf_counter() - start)
        except GatewayError as error:
            return web.json_response(error.body(), status=error.status)
        return web.json_response(
            {
                "output": outcome.output,
                "exit_code": outcome.exit_code,
                "timed_out": outcome.timed_out,
                "limit_hit": outcome.limit_hit,
            }
        )


def _key(request: web.Request) -> str | None:
    """The attempt key of ``request``: its path segment, else its bearer token."""
    if "key" in request.match_info:
        return request.match_info["key"]
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


async def _json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise GatewayError(400, "invalid_request_body", f"the request body is not JSON: {error}") from None
