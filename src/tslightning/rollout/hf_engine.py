"""The embedded CPU rollout engine: ``transformers`` replicas in their own processes (SPEC §3, App. D.2).

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
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.multiprocessing as mp
import transformers
from transformers.cache_utils import DynamicLayer

from tslightning.rollout.core_placement import check_cores, place_this_thread
from tslightning.rollout.engine import (
    Generation,
    GenerationRequest,
    PublishReceipt,
    RolloutEngineError,
    validate_request,
)
from tslightning.rollout.prefix_cache import LayerKV, PrefixKVCache

__all__ = ["HFRolloutEngine"]


class HFRolloutEngine:
    """A pool of ``transformers`` replica processes that sample turns and install published weights.

    Args:
        model_path: A ``save_pretrained`` checkpoint directory (model and config).
        dtype: Dtype the replicas compute in (``torch.float32`` for exact log-probs).
        replicas: Number of replica processes.
        threads_per_replica: ``torch.set_num_threads`` in each replica.
        cpus: CPU cores every replica process is pinned to (``os.sched_setaffinity``); ``None``: not pinned.
        max_batch_size: Most requests one replica decodes together.
        prefix_cache_tokens: Token positions of K/V each replica keeps so a multi-turn request that extends an
            earlier one prefills only its new tokens (:mod:`tslightning.rollout.prefix_cache`); 0 disables reuse.
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
        self._closing = False
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
    def policy_version(self) -> int:
        """Version every replica has acknowledged."""
        return self._policy_version

    def submit(self, request: GenerationRequest) -> Future[Generation]:
        """Queue one request on the least busy replica; the future resolves to its :class:`Generation`."""
        return self._submit([request])[0]

    def generate(self, requests: Sequence[GenerationRequest], timeout: float | None = None) -> list[Generation]:
        """Submit all requests at once (so they can share batches), wait for all, in request order."""
        return [future.result(timeout) for future in self._submit(list(requests))]

    def publish(self, state_dict: Mapping[str, torch.Tensor], policy_version: int) -> PublishReceipt:
        """Install ``state_dict`` (the HF model's names; any device and floating dtype) as ``policy_version``.

        Returns after every replica has copied the weights and acknowledged; see the module docstring for when
        requests switch versions.

        Raises:
            ValueError: If ``policy_version`` does not increase, or names or shapes do not match the model.
            RolloutEngineError: If a replica died or did not acknowledge within ``publish_timeout``.
        """
        with self._publish_lock:
            start = time.perf_counter()
            if policy_version <= self._policy_version:
                raise ValueError(f"policy_version must increase: {policy_version} <= {self._policy_version}.")
            self._raise_if_unusable()
            self._stage(state_dict)
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
            if self._closing:
                return
            self._closing = True
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

    def __enter__(self) -> HFRolloutEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
    def _stage(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        missing = [name for name in self._shared if name not in state_dict]
        unknown = [name for name in state_dict if name not in self._shared and name not in self._aliases]
        mismatched = [
            f"{name} {tuple(tensor.shape)} (engine {tuple(self._shared[name].shape)})"
            for name, tensor in state_dict.items()
            if name in self._shared and tensor.shape != self._shared[name].shape
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
        for name, target in self._shared.items():
            target.copy_(state_dict[name].detach())

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise RolloutEngineError(self._failure)
        if self._closing:
            raise RolloutEngineError("The rollout engine is closed.")

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
            if self._closing:
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
            target=_replica_main, args=(*args, inbox, outbox), name=f"hf-rollout-replica-{index}", daemon=True
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


# ---------------------------------------------------------------------------------------------------------------------
# Replica process


def _replica_main(
    model_path: str | os.PathLike[str],
    dtype: torch.dtype,
    shared: dict[str, torch.Tensor],
    policy_version: int,
    threads: int,
    cpus: tuple[int, ...] | None,
    max_batch_size: int,
    prefix_cache_tokens: int,
    inbox: Any,
    outbox: Connection,
) -> None:
    try:
        if cpus is not None:
            place_this_thread(cpus)
        torch.set_num_threads(threads)
        transformers.utils.logging.disable_progress_bar()
        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        _install(model, shared)
        reuse = prefix_cache_tokens > 0 and supports_prefix_cache(model)
        prefix_cache = PrefixKVCache(prefix_cache_tokens) if reuse else None
        outbox.send(("ready", None))
    except BaseException:
        outbox.send(("fatal", traceback.format_exc()))
        return
    backlog: deque[tuple[str, Any]] = deque()
    while True:
        kind, payload = backlog.popleft() if backlog else inbox.get()
        if kind == "stop":
            return
        if kind == "load":
            _install(model, shared)
            if prefix_cache is not None:
                prefix_cache.clear()  # K/V of the old weights
            policy_version = payload
            outbox.send(("ack", payload))
            continue
        batch = list(payload)
        # Batch whatever else is pending, but never across a "load": what was queued before it uses the old weights.
        while True:
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                break
            if message[0] != "generate":
                backlog.append(message)
                break
            batch.extend(message[1])
        # Shortest contexts first: each sub-batch pads little, and short requests return soonest.
        batch.sort(key=lambda item: len(item[1].prompt_token_ids))
        for start in range(0, len(batch), max_batch_size):
            _answer(model, batch[start : start + max_batch_size], policy_version, outbox, prefix_cache)


@torch.no_grad()
def _install(model: torch.nn.Module, shared: Mapping[str, torch.Tensor]) -> None:
    weights = model.state_dict()
    for name, tensor in shared.items():
        weights[name].copy_(tensor)


def _answer(
    model: transformers.PreTrainedModel,
    batch: list[tuple[int, GenerationRequest]],
    policy_version: int,
    outbox: Connection,
    prefix_cache: PrefixKVCache | None = None,
) -> None:
    tickets = [ticket for ticket, _ in batch]
    try:
        generations = _sample_batch(model, [request for _, request in batch], policy_version, prefix_cache)
    except Exception:
        outbox.send(("failed", (tickets, traceback.format_exc())))
        return
    outbox.send(("done", list(zip(tickets, generations, strict=True))))


@torch.inference_mode()
def _sample_batch(
    model: transformers.PreTrainedModel,
    requests: Sequence[GenerationRequest],
    policy_version: int,
    prefix_cache: PrefixKVCache | None = None,
) -> list[Generation]:
    """Sample every request to its stop token or ``max_tokens``: left-padded prefill, then one token per step.

    With ``prefix_cache``, a request whose prompt extends a kept sequence starts from its K/V and prefills only the
    new tokens; every finished request's sequence (prompt and sampled tokens but the last) is kept in turn.
    """
    start = time.perf_counter()
    reused = [prefix_cache.take(r.prompt_token_ids) if prefix_cache else (0, None) for r in requests]
    input_ids, attention_mask, cache = _prefill_inputs(model, requests, reused)
    past = attention_mask.shape[1] - input_ids.shape[1]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
    generators = [torch.Generator().manual_seed(request.seed) for request in requests]
    temperatures = torch.tensor([request.temperature for request in requests], dtype=torch.float32)
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[float]] = [[] for _ in requests]
    finish: list[str] = ["length"] * len(requests)
    live = list(range(len(requests)))  # request index of each batch row still decoding
    while live:
        logits = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        log_probs = torch.log_softmax(logits.float() / temperatures[live, None], dim=-1)
        keep = []
        for row, index in enumerate(live):
            # One draw per token from this request's own generator: independent of the rest of the batch.
            token = int(torch.multinomial(log_probs[row].exp(), 1, generator=generators[index]))
            tokens[index].append(token)
            logprobs[index].append(float(log_probs[row, token]))
            if token in requests[index].stop_token_ids:
                finish[index] = "stop"
            elif len(tokens[index]) < requests[index].max_tokens:
                keep.append(row)
                continue
            if prefix_cache is not None:  # the cache holds the prompt and every sampled token but this last one
                sequence = (*requests[index].prompt_token_ids, *tokens[index][:-1])
                prefix_cache.store(sequence, _row_kv(cache, row, attention_mask[row].bool()))
        if len(keep) < len(live):
            rows = torch.tensor(keep, dtype=torch.long)
            cache.reorder_cache(rows)  # drop finished rows from the KV cache
            attention_mask, position_ids = attention_mask[rows], position_ids[rows]
        live = [live[row] for row in keep]
        input_ids = torch.tensor([[tokens[index][-1]] for index in live], dtype=torch.long)
        attention_mask = torch.cat([attention_mask, torch.ones(len(live), 1, dtype=torch.long)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
    seconds = time.perf_counter() - start
    timing = {"batch_size": float(len(requests)), "generate_s": seconds}
    return [
        Generation(r.request_id, tuple(t), tuple(lp), f, policy_version, timing)  # type: ignore[arg-type]
        for r, t, lp, f in zip(requests, tokens, logprobs, finish, strict=True)
    ]


def _prefill_inputs(
    model: transformers.PreTrainedModel,
    requests: Sequence[GenerationRequest],
    reused: list[tuple[int, list[LayerKV] | None]],
) -> tuple[torch.Tensor, torch.Tensor, transformers.DynamicCache]:
    """The first forward's inputs: each row's reused K/V left-padded to the longest, then its new prompt tokens
    left-padded to the longest suffix; the 2-D mask marks real positions (``[B, past + suffix]``)."""
    past = max(n for n, _ in reused)
    suffixes = [request.prompt_token_ids[n:] for request, (n, _) in zip(requests, reused, strict=True)]
    width = max(len(suffix) for suffix in suffixes)
    input_ids = torch.zeros(len(requests), width, dtype=torch.long)
    attention_mask = torch.zeros(len(requests), past + width, dtype=torch.long)
    for row, (suffix, (n, _)) in enumerate(zip(suffixes, reused, strict=True)):
        input_ids[row, width - len(suffix) :] = torch.tensor(suffix)
        attention_mask[row, past - n : past] = 1
        attention_mask[row, past + width - len(suffix) :] = 1
    if past == 0:
        return input_ids, attention_mask, transformers.DynamicCache(config=model.config)
    template = next(layers for _, layers in reused if layers is not None)
    data = []
    for layer, (k0, v0) in enumerate(template):
        keys = k0.new_zeros(len(requests), k0.shape[0], past, k0.shape[2])
        values = v0.new_zeros(len(requests), v0.shape[0], past, v0.shape[2])
        for row, (n, layers) in enumerate(reused):
            if layers is not None:
                keys[row, :, past - n :], values[row, :, past - n :] = layers[layer]
        data.append((keys, values))
    return input_ids, attention_mask, transformers.DynamicCache(ddp_cache_data=data, config=model.config)


def _row_kv(cache: transformers.DynamicCache, row: int, valid: torch.Tensor) -> list[LayerKV]:
    """One batch row's K/V at its real (unpadded) positions, copied out of the batch cache."""
    return [(layer.keys[row][:, valid].clone(), layer.values[row][:, valid].clone()) for layer in cache.layers]


def supports_prefix_cache(model: transformers.PreTrainedModel) -> bool:
    """Whether every cache layer is a plain full-attention ``DynamicLayer`` (sliding windows are not reused)."""
    layers = transformers.DynamicCache(config=model.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
