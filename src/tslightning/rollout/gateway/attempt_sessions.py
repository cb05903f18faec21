"""The gateway's attempts: how a call names its attempt, and what each attempt allows.

**Naming.** Each attempt gets a secret key (``tsl-`` and 32 random URL-safe characters) when it opens. A harness
sends it as its OpenAI API key (``Authorization: Bearer <key>``, what every OpenAI-compatible client sends from its
ordinary ``api_key`` setting), or — for a client that can only be given a base URL — as a path segment
``/attempts/<key>/v1/...``. The key is a capability: only the attempt's harness process is given it (the agent's
sandboxed commands have no network, and never see the harness's environment), so no call can act for another
attempt.

**Turns.** Each answered call is one turn; an attempt's calls are answered one at a time, in the order they arrive
(a harness that sends several at once gets them as successive turns).

**Limits.** An attempt answers at most ``max_turns`` calls and ``max_tokens_per_trajectory`` sampled tokens, each call
at most ``max_tokens_per_turn`` (less if the caller asks), within ``max_context_tokens`` of context and a first prompt
of at most ``max_prompt_tokens`` (Table 6, as the built-in agent loop). A call beyond a limit, or for an attempt that
is closed or unknown, is refused with an OpenAI-format error (:mod:`~tslightning.rollout.gateway.errors`) and
the attempt's end reason records why the harness stopped.

**Segments.** A call that does not continue its segment (:mod:`~tslightning.rollout.gateway.conversation`) opens a
new one (:mod:`~tslightning.rollout.gateway.trajectory` says how each segment is scored, under GRPO and OPD);
a gateway made with ``allow_segments=False`` refuses it instead (``history_rewritten``) and the attempt ends there.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tslightning.rollout.agent_loop import AgentLimits, AgentTurn, TaskAttempt
from tslightning.rollout.engine import Generation, GenerationRequest, sampling_seed
from tslightning.rollout.gateway.attempt_log import AttemptLog
from tslightning.rollout.gateway.conversation import ChatTokens, Continuation, SegmentContext
from tslightning.rollout.gateway.errors import GatewayError
from tslightning.rollout.gateway.trajectory import HarnessTrajectory

__all__ = ["AttemptSession", "AttemptSessions", "TurnListener"]

TurnListener = Callable[[HarnessTrajectory, AgentTurn], None]
"""Told of each answered call as soon as its sampled ids are fixed (an OPD turn then goes to the teacher)."""

_CLOSED_KEPT = 65536
"""Closed attempts' keys remembered (a late call gets ``attempt_closed``, not ``invalid_api_key``)."""


@dataclass(eq=False)
class AttemptSession:
    """One open attempt at the gateway: its key, the version it samples at, its trajectory so far.

    Attributes:
        key: The secret that names the attempt in its harness's calls.
        policy_version: The version θ_k every call of the attempt is sampled at.
        attempt: Where the harness's commands run (its live sandbox); ``None``: the harness runs none.
        allow_segments: A rewritten history opens a segment; ``False``: it is refused and the attempt ends.
        end_reason: Why the attempt ended, once a limit refused a call (else ``running``).
        failure: An engine failure while serving a call: the rollout must fail, nothing of it is trained.
    """

    key: str
    trajectory: HarnessTrajectory
    policy_version: int
    limits: AgentLimits
    run_seed: int
    attempt: TaskAttempt | None = None
    allow_segments: bool = True
    listener: TurnListener | None = None
    log: AttemptLog = field(default_factory=AttemptLog)
    closed: bool = False
    end_reason: str = "running"
    failure: str | None = None
    generated: int = 0
    commands: int = 0
    segment: SegmentContext | None = None
    pending: Continuation | None = None
    call_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    command_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def plan_turn(self, chat: ChatTokens, prompt: str | list[int], cap: int | None) -> GenerationRequest:
        """The next call's generation request, or :class:`GatewayError` for a closed attempt or a limit reached."""
        if self.closed:
            raise GatewayError(403, "attempt_closed", f"attempt {self.label} is closed: it takes no more calls")
        self._check_budgets()
        continuation = chat.continuation(self.segment, prompt)
        if continuation.new_segment and self.segment is not None and not self.allow_segments:
            self._refuse(
                403,
                "history_rewritten",
                "history_rewritten",
                f"this call rewrites the attempt's history (it leaves the earlier conversation at position "
                f"{continuation.divergence}); this gateway takes one segment per attempt, so the attempt ends here",
            )
        self._check_context(continuation)
        self.pending = continuation
        return self._request(chat, continuation, cap)

    def _request(self, chat: ChatTokens, continuation: Continuation, cap: int | None) -> GenerationRequest:
        """The call's request: the largest budget every limit allows, seeded like the built-in loop's turn."""
        trajectory, limits, turn = self.trajectory, self.limits, len(self.trajectory.turns)
        budget = min(
            cap or limits.max_tokens_per_turn,
            limits.max_tokens_per_turn,
            limits.max_tokens_per_trajectory - self.generated,
            limits.max_context_tokens - len(continuation.prompt_ids),
        )
        seed = sampling_seed(self.run_seed, trajectory.update, trajectory.task_id, trajectory.trajectory_index, turn)
        return GenerationRequest(
            request_id=f"{trajectory.group_id}/{trajectory.trajectory_index}/{turn}",
            prompt_token_ids=continuation.prompt_ids,
            max_tokens=budget,
            seed=seed,
            temperature=limits.temperature,
            stop_token_ids=(chat.end_of_turn,),
            session=f"{trajectory.group_id}/{trajectory.trajectory_index}",
        )

    def record(self, chat: ChatTokens, generation: Generation, seconds: float) -> tuple[AgentTurn, str, str]:
        """Record the answer to the planned call; returns the turn, the reply's content and its full text."""
        continuation, self.pending = self.pending, None
        content, text = chat.sampled_text(generation.token_ids, stopped=generation.finish_reason == "stop")
        turn = self.trajectory.add_turn(continuation, generation, content, seconds)
        self.generated += len(generation.token_ids)
        segment_text = None if continuation.text is None else continuation.text + text
        self.segment = SegmentContext(continuation.prompt_ids + generation.token_ids, segment_text)
        self.log.call(self.trajectory, turn, continuation, seconds)
        if self.listener is not None:
            self.listener(self.trajectory, turn)
        return turn, content, text

    @property
    def label(self) -> str:
        t = self.trajectory
        return f"({t.group_id!r}, {t.trajectory_index})"

    def _check_budgets(self) -> None:
        limits = self.limits
        if len(self.trajectory.turns) >= limits.max_turns:
            self._refuse(403, "turn_limit_exceeded", "max_turns", f"the attempt's {limits.max_turns} turns are used")
        if self.generated >= limits.max_tokens_per_trajectory:
            self._refuse(
                403,
                "token_limit_exceeded",
                "trajectory_token_limit",
                f"the attempt's {limits.max_tokens_per_trajectory} sampled tokens are used",
            )

    def _check_context(self, continuation: Continuation) -> None:
        limits, length = self.limits, len(continuation.prompt_ids)
        if not self.trajectory.turns and length > limits.max_prompt_tokens:
            self._refuse(
                400,
                "context_length_exceeded",
                "prompt_too_long",
                f"This model's maximum context length for a first prompt is {limits.max_prompt_tokens} tokens; "
                f"the messages have {length}",
            )
        if length >= limits.max_context_tokens:
            self._refuse(
                400,
                "context_length_exceeded",
                "context_limit",
                f"This model's maximum context length is {limits.max_context_tokens} tokens; the messages have "
                f"{length}, leaving no room to generate",
            )

    def _refuse(self, status: int, code: str, end_reason: str, message: str) -> None:
        self.end_reason = end_reason
        self.log.refusal(code, message)
        raise GatewayError(status, code, f"{message} (attempt {self.label})")


class AttemptSessions:
    """The open attempts by key, and the keys of recently closed ones; thread-safe."""

    def __init__(self) -> None:
        self._open: dict[str, AttemptSession] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, make: Callable[[str], AttemptSession]) -> AttemptSession:
        """A new attempt built by ``make(key)`` with a fresh secret key."""
        key = "tsl-" + secrets.token_urlsafe(24)
        session = make(key)
        with self._lock:
            self._open[key] = session
        return session

    def get(self, key: str | None) -> AttemptSession:
        """The open attempt named by ``key``; :class:`GatewayError` 401 (unknown) or 403 (closed)."""
        with self._lock:
            session = self._open.get(key or "")
            closed = key in self._closed
        if session is not None:
            return session
        if closed:
            raise GatewayError(403, "attempt_closed", "this attempt is closed: it takes no more calls")
        raise GatewayError(
            401,
            "invalid_api_key",
            "no open attempt has this key: give the attempt's key as the API key (Authorization: Bearer <key>) "
            "or in the path (/attempts/<key>/v1/...)",
        )

    def forget(self, session: AttemptSession) -> None:
        """Move ``session`` to the closed keys (call once it is closed)."""
        with self._lock:
            self._open.pop(session.key, None)
            self._closed[session.key] = None
            if len(self._closed) > _CLOSED_KEPT:
                self._closed.popitem(last=False)

    @property
    def open_sessions(self) -> list[AttemptSession]:
        with self._lock:
            return list(self._open.values())
