"""The ``vllm_server`` rollout engine: running vLLM OpenAI-compatible servers, token-in/token-out (App. D.2).

:class:`VLLMServerEngine` sends every turn the moment the agent loop submits it as one ``POST
/inference/v1/generate`` (prompt token ids in; sampled ids, their log-probs under the sampling distribution and the
weight versions that sampled them out; the request's seed, temperature 1-style sampling with top-p 1 and no top-k),
so each trajectory's turn comes back as soon as the server finished it — readiness is per request, the server's
continuous batching decides the rest. A trajectory's turns go to the same server (session affinity: its prefix
cache holds the earlier turns); a new trajectory goes to the server with the fewest requests in flight.

Publication (:mod:`tslightning.rollout.vllm_server.publication`) uses vLLM's own protocol: pause → transfer → finish
with ``weight_version`` → resume. ``publish`` first lets the requests already sent finish (they are answered by the
old version) and holds new ones until every server acknowledged the new version; every generation is then checked
against the version the server reports for each of its tokens, and a mismatch fails that request
(:class:`~tslightning.rollout.engine.RolloutEngineError`): no token sampled at another version reaches the learner.

A server that stops answering is dropped: its requests are sent again to another server (same seed, same version,
so the same tokens; the failed attempt returned none, so no turn is counted twice or lost) and publications leave it
out; when none is left the engine fails with :class:`~tslightning.rollout.engine.RolloutEngineError`.

With a launcher (``replicas``, :mod:`tslightning.rollout.vllm_server.ray_launcher`) a dropped server is reported to it
and restarted; a server that dies during a publication is dropped too and the publication completes on the others (with
none left it fails). At each publication the engine asks the launcher which replicas serve: a restarted one (a new
generation) is checked, joins a new transfer group and receives θ_k with the others; it serves again only once it
acknowledged version k.

A LoRA run (``adapter``) publishes the adapter, not merged weights
(:mod:`tslightning.rollout.vllm_server.lora_adapter`): each version's adapter is loaded under a versioned name, and
every request of update k names θ_k's adapter as its ``model`` — the server's answer must name it too.

At start the engine checks each server (:mod:`tslightning.rollout.vllm_server.check`), joins its weight-transfer
group and publishes θ_0 from the policy's checkpoint at ``policy_version``, so what the servers were started with
does not matter beyond the architecture and tokenizer. The servers are the user's: ``close`` leaves them running.

Several learner ranks share the servers (``sharing``): each rank's engine sends its own share of the trajectories
(routing stays local, :mod:`tslightning.rollout.vllm_server.session_routing`), but only global rank 0's engine
(``publisher``) joins the weight-transfer groups, publishes θ_0 and every θ_{k+1} — once per server — and talks to the
launcher. The other ranks' engines (``follower``) start once θ_0 is served and :meth:`~VLLMServerEngine.follow` each
publication the publisher reports (:meth:`~VLLMServerEngine.served`: version, adapter, the servers that acknowledged it,
a restarted replica's new URL among them); every rank still checks every token's weight version.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import requests
import torch

from tslightning.rollout.engine import (
    Generation,
    GenerationRequest,
    PublishReceipt,
    QueuedEngine,
    RolloutEngineError,
    WeightStream,
    checkpoint_weights,
    validate_request,
    weight_stream,
)
from tslightning.rollout.speculative import SpeculativeSettings
from tslightning.rollout.vllm_server.check import (
    BACKENDS,
    Expected,
    answers,
    probe_ids,
    server_problems,
    url_problems,
)
from tslightning.rollout.vllm_server.client import ServerError, ThreadClients
from tslightning.rollout.vllm_server.generation import checked_generation, generate_body
from tslightning.rollout.vllm_server.lora_adapter import (
    AdapterSpec,
    adapter_name,
    adapter_problems,
    publish_adapter,
    write_adapter,
)
from tslightning.rollout.vllm_server.session_routing import SessionRouter
from tslightning.rollout.vllm_server.shared_servers import ServedVersion, SharedServers

__all__ = ["ServedVersion", "SessionRouter", "VLLMServerEngine"]


class VLLMServerEngine(SharedServers, QueuedEngine):
    """Rollouts on running vLLM servers, one HTTP request per turn, with versioned weight publication.

    Args:
        urls: The servers' base URLs (``rollout.server_urls``).
        policy_dir: θ_0's checkpoint (``save_pretrained``): its tokenizer is checked against each server's and its
            weights are published at ``policy_version`` before the engine serves.
        transport: ``gloo`` (CPU) or ``nccl`` (GPUs); see :mod:`tslightning.rollout.vllm_server.publication`.
        dtype: The dtype the servers must serve.
        context_tokens: Longest prompt plus completion a trajectory can reach; each server must serve it.
        policy_version: The version θ_0 is published at.
        timeout_s: Seconds one request, one check or one publication step may take.
        max_connections: Requests in flight at once, over all servers.
        replicas: The launcher that runs the servers (``urls`` are its URLs): told of each server that stopped
            answering, asked at each publication which restarted ones to take back (see the module docstring); closed
            with the engine. ``None``: the servers are the user's.
        adapter: A LoRA run's adapter: :meth:`publish` then takes peft's adapter state dict and serves it under a
            versioned name (the servers run with LoRA enabled); θ_0's base weights are still published at start.
        sharing: ``none`` (one learner rank); ``publisher`` (global rank 0 of several: it publishes for all, and the
            other ranks :meth:`follow` its :meth:`served`); ``follower`` (another rank: it never publishes, starts
            serving at ``policy_version`` — create it once the publisher published θ_0 — and has no ``replicas``).
        rank: This learner rank: its router's ties start at server ``rank`` (ranks start spread over the servers).
        speculative: ``rollout.speculative``: every server must speculate with these settings through an exact
            sampler (checked at start); generations then carry acceptance counts and no log-probs.
    """

    def __init__(
        self,
        urls: Sequence[str],
        policy_dir: str | Path,
        *,
        transport: str = "gloo",
        dtype: str = "float32",
        context_tokens: int = 4096,
        policy_version: int = 0,
        timeout_s: float = 600.0,
        max_connections: int = 64,
        replicas: Any = None,
        adapter: AdapterSpec | None = None,
        sharing: Literal["none", "publisher", "follower"] = "none",
        rank: int = 0,
        speculative: SpeculativeSettings | None = None,
    ) -> None:
        problems = url_problems(urls)
        if problems:
            raise ValueError("; ".join(problems))
        self.urls = [url.rstrip("/") for url in urls]
        self._policy_dir, self._timeout_s = Path(policy_dir), timeout_s
        self._vocab_size = int(json.loads((self._policy_dir / "config.json").read_text())["vocab_size"])
        self._context_tokens = context_tokens
        self._dtype = getattr(torch, dtype)
        expected = Expected(BACKENDS[transport], dtype, context_tokens, probe_ids(self._policy_dir), speculative)
        self.speculative = speculative
        self._expected, self._transport, self.replicas = expected, transport, replicas
        self._generations = {i: g for i, (g, _) in replicas.serving().items()} if replicas is not None else {}
        problems = [problem for url in self.urls for problem in server_problems(url, expected, min(timeout_s, 60))]
        if adapter is not None:
            problems += [problem for url in self.urls for problem in adapter_problems(url, adapter.r, timeout_s)]
        if problems:
            raise ValueError("; ".join(problems))
        self._policy_version, self._failure, self._closed = policy_version - 1, None, False
        self.adapter, self._model = adapter, None  # the served adapter's name; None: the base model
        self._gate = threading.Condition()  # guards the fields below; publish waits on it for in-flight requests
        self._publishing, self._router = False, SessionRouter(len(self.urls), first=rank)
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="vllm-server-request")
        self._clients = ThreadClients(timeout_s)
        self._sent = itertools.count()
        self.sharing = sharing
        if sharing == "follower":  # the publisher owns the transfer groups and published θ_0
            self._transports, self._policy_version = [], policy_version
            return
        from tslightning.rollout.vllm_server.publication import join_transfer_groups  # imports vLLM

        self._transports = join_transfer_groups(self.urls, transport, timeout_s)
        try:
            self._publish_checkpoint(policy_version)
        except BaseException:
            self.close()
            raise

    @property
    def publishes_adapter(self) -> bool:
        """Whether :meth:`publish` takes a LoRA adapter's state dict (peft names) instead of full weights."""
        return self.adapter is not None

    @property
    def serving_dtype(self) -> torch.dtype:
        """The dtype the servers serve (full-weight publications are cast to it as they stream)."""
        return self._dtype

    def publish(self, weights: Mapping[str, torch.Tensor] | WeightStream, policy_version: int) -> PublishReceipt:
        """Install ``weights`` on every server at ``policy_version``; returns after each acknowledged.

        ``weights`` holds the full weights (HF names; a state dict, or a
        :class:`~tslightning.rollout.engine.WeightStream` streamed to each server in turn, one tensor at a time), or —
        when :attr:`publishes_adapter` — peft's adapter state dict, written under ``adapter.directory`` and loaded as
        ``tslightning-policy-v<policy_version>``.

        Requests already sent finish first (answered by the old version); requests submitted meanwhile wait and are
        sent to the new one.

        Servers dropped after they stopped answering are left out (they would need θ_k before serving again); one
        that stops answering during the publication is dropped and the others complete it. Replicas the launcher
        restarted receive θ_k too and serve again once they acknowledged it.

        Raises:
            ValueError: If ``policy_version`` does not increase.
            RuntimeError: On a ``follower`` (global rank 0's engine publishes; this one :meth:`follow` s it).
            RolloutEngineError: If a server that still answers failed a step, or none acknowledged; the engine is then
                unusable (servers may disagree).
        """
        if self.sharing == "follower":
            raise RuntimeError("a follower's engine does not publish: global rank 0's does, and this one follows it")
        return self._publish(weight_stream(weights), policy_version, as_adapter=self.adapter is not None)

    def _publish(self, state: WeightStream, policy_version: int, as_adapter: bool) -> PublishReceipt:
        start = time.perf_counter()
        with self._gate:
            self._check_next_version(policy_version)
            self._publishing = True
            self._gate.wait_for(lambda: not any(self._router.in_flight))
        try:
            path = write_adapter(self.adapter, dict(state), policy_version) if as_adapter else None
            previous = self._policy_version if self._model is not None else None
            joining = self._join_restarted()
            acknowledged = [
                server
                for server in sorted({*self._router.alive, *joining})
                # a restarted replica holds no earlier adapter to unload
                if self._publish_to(server, state, policy_version, path, None if server in joining else previous)
            ]
            if not acknowledged:
                self._failure = (
                    f"No vLLM server acknowledged policy version {policy_version}: every one stopped answering; "
                    "restart them and resume from a checkpoint."
                )
                raise RolloutEngineError(self._failure)
            with self._gate:
                for server in joining:
                    if server in acknowledged:
                        self._router.readmit(server)
            self._policy_version = policy_version
            self._model = None if path is None else adapter_name(policy_version)
        finally:
            with self._gate:
                self._publishing = False
                self._gate.notify_all()
        return PublishReceipt(policy_version, len(self._router.alive), time.perf_counter() - start)

    def _publish_to(
        self,
        server: int,
        state: WeightStream,
        policy_version: int,
        adapter_path: Path | None,
        previous: int | None,
    ) -> bool:
        """Publish to one server — ``state`` through its transport, or (``adapter_path``) the adapter written there,
        unloading ``previous``'s — ``True`` once it acknowledged, ``False`` if it stopped answering (it is dropped).

        Raises:
            RolloutEngineError: If the server still answers but failed a step.
        """
        try:
            if adapter_path is None:
                self._transports[server].publish(state, policy_version)
            else:
                publish_adapter(self.urls[server], adapter_path, policy_version, previous, self._timeout_s)
            return True
        except Exception as error:
            if not answers(self.urls[server]):  # died mid-update: the others complete it
                self._lose(server)
                return False
            self._failure = (
                f"Publishing policy version {policy_version} to {self.urls[server]} failed ({error}); the servers may "
                "now serve different weights: close this engine, restart the servers and resume from a checkpoint."
            )
            raise RolloutEngineError(self._failure) from error

    def _join_restarted(self) -> list[int]:
        """The replicas the launcher restarted since they last served, each checked and in a new transfer group
        (not yet in rotation: they serve once they acknowledged the publication under way)."""
        joining: list[int] = []
        serving = self.replicas.serving() if self.replicas is not None else {}
        for server, (generation, url) in serving.items():
            if self._generations.get(server) == generation:
                continue
            self._lose(server, report=False)  # the old server of this replica is gone
            url = url.rstrip("/")
            try:
                problems = server_problems(url, self._expected, min(self._timeout_s, 60))
                if self.adapter is not None:
                    problems += adapter_problems(url, self.adapter.r, self._timeout_s)
                if not problems:
                    self._transports[server] = self._join(url)
            except Exception as error:
                if answers(url):
                    raise RolloutEngineError(f"Restarted replica {server} ({url}) could not join: {error}") from error
                self.replicas.lost(server)  # died again: the launcher restarts it once more
                continue
            if problems:
                raise RolloutEngineError(f"Restarted replica {server} cannot serve: {'; '.join(problems)}")
            self.urls[server], self._generations[server] = url, generation
            joining.append(server)
        return joining

    def _join(self, url: str) -> Any:
        from tslightning.rollout.vllm_server.publication import join_transfer_groups

        return join_transfer_groups([url], self._transport, self._timeout_s)[0]

    def _lose(self, server: int, report: bool = True) -> None:
        """Drop ``server`` from rotation, leave its transfer group and (``report``) have the launcher restart it."""
        with self._gate:
            self._router.drop(server)
        try:
            self._transports[server].close()
        except Exception:  # a server already gone has no group to leave
            pass
        if report and self.replicas is not None:
            self.replicas.lost(server)

    def close(self) -> None:
        """Fail queued requests, wait for those in flight, leave the servers' transfer groups (and stop the
        launcher's replicas). Idempotent."""
        with self._gate:
            if self._closed:
                return
            self._closed = True
            self._gate.notify_all()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for transport in getattr(self, "_transports", []):
            try:
                transport.close()
            except Exception:  # a server already gone has no group to leave
                pass
        if self.replicas is not None:
            self.replicas.close()

    def _publish_checkpoint(self, policy_version: int) -> None:
        state = checkpoint_weights(self._policy_dir)
        try:
            self._publish(state, policy_version, as_adapter=False)  # a LoRA run's base weights, too
        except RolloutEngineError as error:
            raise ValueError(
                f"rollout.server_urls: publishing θ_0 from {self._policy_dir} failed — a server serves another "
                f"architecture than the policy, or cannot receive weights: {error.__cause__}"
            ) from error

    def _submit(self, requests_: list[GenerationRequest]) -> list[Future[Generation]]:
        for request in requests_:
            validate_request(request, self._vocab_size)
            if len(request.prompt_token_ids) + request.max_tokens > self._context_tokens:
                raise ValueError(
                    f"Request {request.request_id!r}: {len(request.prompt_token_ids)} prompt + {request.max_tokens} "
                    f"new tokens exceed the servers' context of {self._context_tokens}"
                )
        with self._gate:
            self._raise_if_unusable()
            # Counted in flight now, at this version, unless a publication is under way: publish then waits for
            # them, so a request submitted before publish was called is answered by the old version.
            tickets = [None if self._publishing else self._ticket(request) for request in requests_]
            return [self._pool.submit(self._generate, r, t) for r, t in zip(requests_, tickets, strict=True)]

    def _generate(self, request: GenerationRequest, ticket: tuple[int, int, str | None] | None) -> Generation:
        """One request on its session's server, at the version current when it was sent (a pool thread). A server
        that stops answering is dropped and the request sent again to another (same seed, same version: the same
        tokens; the failed attempt returned none); with no server left the engine fails."""
        while True:
            server, version, model = ticket or self._acquire(request)
            ticket, start = None, time.perf_counter()
            try:
                # vLLM's ids must be unique among requests in flight; the caller's may repeat across updates.
                request_id, logprobs = f"{request.request_id}#{next(self._sent)}", self.speculative is None
                body = generate_body(request, request_id, model, logprobs)
                answer = self._post(self.urls[server], body)
                break
            except ServerGone as gone:
                self._drop(server, gone)
            finally:
                with self._gate:
                    self._router.done(server)
                    self._gate.notify_all()
        generation = checked_generation(request, answer, version, model, self.urls[server], logprobs)
        return replace(generation, timing={"request_s": time.perf_counter() - start, "server": float(server)})

    def _drop(self, server: int, gone: ServerGone) -> None:
        """Serve without ``server`` from now on; fail the engine when it was the last one."""
        with self._gate:
            self._router.drop(server)
            if self.replicas is not None:
                self.replicas.lost(server)
            if not self._router.alive:
                self._failure = f"Every vLLM server stopped answering (last: {gone}): restart them and resume."
                raise RolloutEngineError(self._failure) from None

    def _acquire(self, request: GenerationRequest) -> tuple[int, int, str | None]:
        """Wait out a publication, then count the request in flight on its session's server."""
        with self._gate:
            self._gate.wait_for(lambda: not self._publishing or self._closed)
            self._raise_if_unusable()
            return self._ticket(request)

    def _ticket(self, request: GenerationRequest) -> tuple[int, int, str | None]:
        """(server, version, adapter name or None) of a request counted in flight; call with the gate held."""
        return self._router.send(request.session or request.request_id), self._policy_version, self._model

    def _post(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        server = self._clients.of(url)
        try:
            return server.generate(body, resend=True)
        except requests.RequestException as error:
            raise ServerGone(f"vLLM server {url} stopped answering ({type(error).__name__}: {error})") from None
        except ServerError as error:
            raise RolloutEngineError(f"vLLM server {url} refused {body['request_id']!r}: {error.text[:300]}") from None


class ServerGone(RolloutEngineError):
    """A server stopped answering (connection refused, reset or timed out)."""
