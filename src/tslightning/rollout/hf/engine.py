"""The embedded CPU rollout engine: ``transformers`` replicas in their own processes (App. D.2).

:class:`HFRolloutEngine` starts a rollout pool of ``replicas`` processes (``torch.multiprocessing``, spawn), so
generation overlaps with the learner the way a separate GPU pool would. Each replica batches whatever requests are
pending (left-padded) and samples them with a KV-cache decode loop in which every request draws from its OWN
``torch.Generator`` seeded with ``request.seed``: a request samples the same tokens alone or in any batch, up to float
rounding. Sampling is from the full softmax at the request's temperature (top-p 1, no top-k); the returned log-probs
are ``log_softmax`` of that sampling distribution, in float32.

Publication happens in memory. At startup every weight is copied into a shared-memory tensor
(``tensor.share_memory_()``); :meth:`HFRolloutEngine.publish` copies the learner's state dict into them, then tells
each replica "load version k" through its request queue and returns once every replica has acknowledged. Semantics:

* A replica never changes weights during a generation step. Messages are served in order, so every request
  submitted before ``publish`` was called is answered by the old version, and every request submitted after it
  returned by the new one; each :class:`~tslightning.rollout.engine.Generation` carries the version that sampled
  all of its tokens. ``publish`` therefore waits for batches already running to finish.
* Each batch builds a fresh KV cache, so no policy-dependent cache survives a publication (there is no prefix cache).
* If a replica dies, its pending futures fail with :class:`~tslightning.rollout.engine.RolloutEngineError`, and so do
  later ``submit``/``publish`` calls: a pool that cannot acknowledge a version cannot serve zero staleness.

Entry scripts that create the engine need an ``if __name__ == "__main__":`` guard (spawned replicas re-import them).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp
import transformers

from tslightning.rollout.core_placement import check_cores
from tslightning.rollout.engine import (
    Generation,
    GenerationRequest,
    PublishReceipt,
    QueuedEngine,
    RolloutEngineError,
    WeightStream,
    validate_request,
    weight_stream,
)
from tslightning.rollout.hf.replica import replica_main

__all__ = ["HFRolloutEngine"]


class HFRolloutEngine(QueuedEngine):
    """A pool of ``transformers`` replica processes that sample turns and install published weights.

    Args:
        model_path: A ``save_pretrained`` checkpoint directory (model and config).
        dtype: Dtype the replicas compute in (``torch.float32`` for exact log-probs).
        replicas: Number of replica processes.
        threads_per_replica: ``torch.set_num_threads`` in each replica.
        cpus: CPU cores every replica process is pinned to (``os.sched_setaffinity``); ``None``: not pinned.
        max_batch_size: Most requests one replica decodes together.
        prefix_cache_tokens: Token positions of K/V each replica keeps so a multi-turn request that extends an
            earlier one prefills only its new tokens (:mod:`tslightning.rollout.hf.prefix_cache`); 0 disables reuse.
        policy_version: Version of the checkpoint's weights.
        start_timeout: Seconds to wait for every replica to load the model.
        publish_timeout: Seconds ``publish`` waits for every acknowledgement; it includes batches still running.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        dtype: torch.dtype | str = torch.float32,
        replicas: int = 1,
        threads_per_replica: int = 1,
        cpus: Sequence[int] | None = None,
        max_batch_size: int = 64,
        prefix_cache_tokens: int = 65536,
        policy_version: int = 0,
        start_timeout: float = 300.0,
        publish_timeout: float = 600.0,
    ) -> None:
        _check_positive(replicas=replicas, threads_per_replica=threads_per_replica, max_batch_size=max_batch_size)
        if prefix_cache_tokens < 0:
            raise ValueError(
                f"HFRolloutEngine: prefix_cache_tokens must be >= 0 (0 disables reuse), got {prefix_cache_tokens}"
            )
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        check_cores("HFRolloutEngine", cpus)
        self._dtype = dtype
        self._shared, self._aliases, self._vocab_size = _stage_initial_weights(model_path, dtype)
        self._policy_version = policy_version
        self._publish_timeout = publish_timeout
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._publish_lock = threading.Lock()
        self._futures: dict[int, tuple[Future[Generation], float]] = {}
        self._tickets = itertools.count()
        self._ready = 0
        self._acks: dict[int, set[int]] = {}
        self._failure: str | None = None
        self._closed = False
        context = mp.get_context("spawn")
        cpus = None if cpus is None else tuple(cpus)
        replica_args = (
            model_path,
            dtype,
            self._shared,
            policy_version,
            threads_per_replica,
            cpus,
            max_batch_size,
            prefix_cache_tokens,
        )
        self._replicas = [_Replica.start(context, index, replica_args) for index in range(replicas)]
        self._reader = threading.Thread(target=self._read, name="hf-rollout-reader", daemon=True)
        self._reader.start()
        with self._changed:
            started = self._changed.wait_for(
                lambda: self._ready == replicas or self._failure is not None, start_timeout
            )
            failure = self._failure or (None if started else f"rollout replicas did not start in {start_timeout} s")
        if failure is not None:
            self.close()
            raise RolloutEngineError(failure)

    @property
    def serving_dtype(self) -> torch.dtype:
        """The dtype the replicas compute in (publications are cast to it as they stream)."""
        return self._dtype

    def publish(self, weights: Mapping[str, torch.Tensor] | WeightStream, policy_version: int) -> PublishReceipt:
        """Install ``weights`` (a state dict or a :class:`~tslightning.rollout.engine.WeightStream`, the HF model's
        names; any device and floating dtype) as ``policy_version``.

        Returns after every replica has copied the weights and acknowledged; see the module docstring for when
        requests switch versions.

        Raises:
            ValueError: If ``policy_version`` does not increase, or names or shapes do not match the model.
            RolloutEngineError: If a replica died or did not acknowledge within ``publish_timeout``.
        """
        with self._publish_lock:
            start = time.perf_counter()
            self._check_next_version(policy_version)
            self._stage(weight_stream(weights))
            with self._changed:
                self._raise_if_unusable()
                for replica in self._replicas:
                    replica.inbox.put(("load", policy_version))
                everyone = {replica.index for replica in self._replicas}
                acked = self._changed.wait_for(
                    lambda: self._failure is not None or self._acks.get(policy_version) == everyone,
                    self._publish_timeout,
                )
                self._raise_if_unusable()
                if not acked:
                    missing = sorted(everyone - self._acks.get(policy_version, set()))
                    self._failure = (
                        f"Rollout replicas {missing} did not acknowledge policy version {policy_version} within "
                        f"{self._publish_timeout} s (publish_timeout; it includes batches still running). The pool "
                        "may now serve mixed versions: close this engine and start a new one."
                    )
                    raise RolloutEngineError(self._failure)
                del self._acks[policy_version]
                self._policy_version = policy_version
            return PublishReceipt(policy_version, len(self._replicas), time.perf_counter() - start)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the replicas (terminating any still busy after ``timeout`` s); pending futures fail. Idempotent."""
        with self._changed:
            if self._closed:
                return
            self._closed = True
        for replica in self._replicas:
            replica.inbox.put(("stop", None))
        deadline = time.monotonic() + timeout
        for replica in self._replicas:
            replica.stop(max(0.0, deadline - time.monotonic()))
        self._reader.join(timeout=10)
        with self._changed:
            futures, self._futures = list(self._futures.values()), {}
        for future, _ in futures:
            _settle(future, RolloutEngineError("The rollout engine was closed before this request finished."))

    def _submit(self, requests: list[GenerationRequest]) -> list[Future[Generation]]:
        for request in requests:
            validate_request(request, self._vocab_size)
        futures: list[Future[Generation]] = [Future() for _ in requests]
        now = time.perf_counter()
        with self._lock:
            self._raise_if_unusable()
            batches: dict[int, list[tuple[int, GenerationRequest]]] = {}
            for request, future in zip(requests, futures, strict=True):
                replica = min(self._replicas, key=lambda r: len(r.tickets))
                ticket = next(self._tickets)
                replica.tickets.add(ticket)
                self._futures[ticket] = (future, now)
                batches.setdefault(replica.index, []).append((ticket, request))
            # Put under the lock: submissions and "load" messages then have one order on every replica.
            for index, items in batches.items():
                self._replicas[index].inbox.put(("generate", items))
        return futures

    @torch.no_grad()
    def _stage(self, weights: WeightStream) -> None:
        shapes = {meta.name: tuple(meta.shape) for meta in weights.metadata()}
        missing = [name for name in self._shared if name not in shapes]
        unknown = [name for name in shapes if name not in self._shared and name not in self._aliases]
        mismatched = [
            f"{name} {shape} (engine {tuple(self._shared[name].shape)})"
            for name, shape in shapes.items()
            if name in self._shared and shape != tuple(self._shared[name].shape)
        ]
        problems = [
            f"{label}: {', '.join(names)}"
            for label, names in (("missing", missing), ("unknown", unknown), ("wrong shape", mismatched))
            if names
        ]
        if problems:
            raise ValueError(
                "Cannot publish this state dict (" + "; ".join(problems) + "). Publish the full, unwrapped "
                "model.state_dict() of the served architecture (merge adapters and gather shards first)."
            )
        # Safe to overwrite: the previous publication was acknowledged, so no replica is reading these tensors.
        for name, tensor in weights:  # one tensor at a time: a sharded learner gathers each as it comes
            if name in self._shared:
                self._shared[name].copy_(tensor.detach())

    def _read(self) -> None:
        """Reader thread: route replica messages to futures and acks; turn a replica's exit into errors."""
        handles: dict[Any, _Replica] = {}
        for replica in self._replicas:
            handles[replica.conn] = handles[replica.process.sentinel] = replica
        while handles:
            for handle in wait(list(handles)):
                replica = handles.get(handle)
                if replica is None:
                    continue
                if handle is replica.conn:
                    try:
                        self._on_message(replica, replica.conn.recv())
                        continue
                    except (EOFError, OSError):
                        pass
                # The replica exited (or closed its pipe): first take what it sent before, then report it.
                for message in _drain(replica.conn):
                    self._on_message(replica, message)
                del handles[replica.conn], handles[replica.process.sentinel]
                self._on_exit(replica)

    def _on_message(self, replica: _Replica, message: tuple[str, Any]) -> None:
        kind, payload = message
        settled: list[tuple[Future[Generation], Generation | BaseException]] = []
        now = time.perf_counter()
        with self._changed:
            if kind == "ready":
                self._ready += 1
            elif kind == "fatal":
                self._failure = f"Rollout replica {replica.index} failed to start:\n{payload}"
            elif kind == "ack":
                self._acks.setdefault(payload, set()).add(replica.index)
            elif kind == "done":
                for ticket, generation in payload:
                    replica.tickets.discard(ticket)
                    if ticket not in self._futures:
                        continue
                    future, submitted = self._futures.pop(ticket)
                    timing = {**generation.timing, "latency_s": now - submitted}
                    settled.append((future, dataclasses.replace(generation, timing=timing)))
            elif kind == "failed":
                tickets, error = payload
                for ticket in tickets:
                    replica.tickets.discard(ticket)
                    if ticket in self._futures:
                        failure = RolloutEngineError(f"Generation failed in replica {replica.index}:\n{error}")
                        settled.append((self._futures.pop(ticket)[0], failure))
            self._changed.notify_all()
        # Outside the lock: done-callbacks run in this thread and may submit again.
        for future, outcome in settled:
            _settle(future, outcome)

    def _on_exit(self, replica: _Replica) -> None:
        replica.process.join(timeout=5)
        with self._changed:
            if self._closed:
                message = "The rollout engine was closed before this request finished."
            else:
                message = (
                    f"Rollout replica {replica.index} (pid {replica.process.pid}) {_describe_exit(replica.process)} "
                    "while the engine was running. Its requests are lost and the pool can no longer acknowledge "
                    "publications: close this engine and start a new one."
                )
                self._failure = self._failure or message
            lost = [self._futures.pop(ticket)[0] for ticket in replica.tickets if ticket in self._futures]
            replica.tickets.clear()
            self._changed.notify_all()
        for future in lost:
            _settle(future, RolloutEngineError(message))


@dataclass(eq=False)
class _Replica:
    """The parent's handles on one replica process."""

    index: int
    process: Any
    inbox: Any
    conn: Connection
    tickets: set[int] = field(default_factory=set)

    @classmethod
    def start(cls, context: Any, index: int, args: tuple[Any, ...]) -> _Replica:
        conn, outbox = context.Pipe(duplex=False)
        inbox = context.Queue()
        process = context.Process(
            target=replica_main, args=(*args, inbox, outbox), name=f"hf-rollout-replica-{index}", daemon=True
        )
        process.start()
        outbox.close()  # The replica now holds the only write end, so its death reads as EOF here.
        return cls(index, process, inbox, conn)

    def stop(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.inbox.cancel_join_thread()  # Never block on a queue the replica will no longer read.
        self.inbox.close()


def _check_positive(**values: int) -> None:
    problems = [f"{name} must be >= 1, got {value}" for name, value in values.items() if value < 1]
    if problems:
        raise ValueError("HFRolloutEngine: " + "; ".join(problems) + ".")


def _stage_initial_weights(
    model_path: str | os.PathLike[str], dtype: torch.dtype
) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
    """Shared-memory copies of every distinct weight, the tied names that alias them, and the vocabulary size."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    shared: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    owners: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in owners:
            aliases[name] = owners[key]  # e.g. a tied lm_head.weight
            continue
        owners[key] = name
        shared[name] = tensor.detach().share_memory_()
    return shared, aliases, model.get_input_embeddings().num_embeddings


def _drain(conn: Connection) -> list[tuple[str, Any]]:
    messages = []
    try:
        while conn.poll():
            messages.append(conn.recv())
    except (EOFError, OSError):
        pass
    return messages


def _describe_exit(process: Any) -> str:
    code = process.exitcode
    if code is None:
        return "closed its pipe"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _settle(future: Future[Generation], outcome: Generation | BaseException) -> None:
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:  # cancelled by the caller
        pass
