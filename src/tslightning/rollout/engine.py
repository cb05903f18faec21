"""The rollout engine interface shared by the HF and vLLM engines (App. D.2).

An engine turns :class:`GenerationRequest` s into :class:`Generation` s with the exact sampled token ids and their
log-probabilities under the serving policy, stamped with that policy's version. Requests are submitted one at a
time and answered through futures, so many trajectories can wait on generation (or on their tools) concurrently
while the engine batches whatever is pending. :meth:`RolloutEngine.publish` installs θ_{k+1} on every replica and
returns only once each has acknowledged, after clearing policy-dependent caches (prefix / KV).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from tslightning.rollout.speculative import SpeculationStats


def sampling_seed(run_seed: int, update: int, task_id: str, trajectory: int, turn: int) -> int:
    """A 63-bit sampling seed from (run seed, update, task, trajectory, turn), never from arrival order (App. D.2)."""
    key = f"{run_seed}/{update}/{task_id}/{trajectory}/{turn}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "big") >> 1


@dataclass(frozen=True)
class GenerationRequest:
    """One assistant turn to sample.

    Attributes:
        request_id: Caller-chosen id, echoed in the :class:`Generation`.
        prompt_token_ids: The full causal context as token ids (never re-tokenized by the engine).
        max_tokens: Most tokens to generate (Table 6: 1,024 per turn, less if the trajectory budget is lower).
        seed: Sampling seed (see :func:`sampling_seed`).
        temperature: Sampling temperature (Table 6: 1.0; top-p 1.0, top-k disabled).
        stop_token_ids: Generation stops after emitting any of these (the chat template's end-of-turn token).
        session: Requests of one session (a trajectory's turns) go to the same replica where an engine has several
            (its prefix cache holds the earlier turns); ``None``: the request is its own session.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    seed: int
    temperature: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    session: str | None = None


@dataclass(frozen=True)
class Generation:
    """What the engine sampled for one request.

    Attributes:
        token_ids: The sampled ids, including the stop token when one ended the turn.
        logprobs: log π_θk of each sampled id under the sampling distribution, ``len(logprobs) == len(token_ids)``;
            ``None`` when the engine cannot vouch for them (speculative decoding: what vLLM reports for accepted
            draft tokens is not the sampling distribution's). Nothing in training reads them: the learner scores
            the sampled ids itself.
        finish_reason: ``stop`` (a stop token) or ``length`` (``max_tokens`` reached).
        policy_version: Version k of the weights that sampled every token.
        timing: Seconds spent, by phase (engine-specific keys).
        speculation: What speculative decoding did for this request (``None``: it was sampled without).
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: Literal["stop", "length"]
    policy_version: int
    timing: Mapping[str, float] = field(default_factory=dict)
    speculation: SpeculationStats | None = None


@dataclass(frozen=True)
class PublishReceipt:
    """Acknowledgement that every replica serves ``policy_version`` (caches cleared)."""

    policy_version: int
    replicas: int
    seconds: float


@dataclass(frozen=True)
class TensorMeta:
    """One published tensor's name (the HF checkpoint name), dtype (as sent: the served dtype) and full shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class WeightStream:
    """Weights to publish as ``(name, full tensor)`` pairs, produced one at a time each time it is iterated, so no
    full copy of the model is ever staged; their names, dtypes and shapes are known up front (:meth:`metadata`), so
    an engine can lay out or announce a transfer before any tensor exists.

    Producing a tensor may be a collective (sharded learners gather each parameter): an engine iterates the stream
    once per receiver and drops each tensor once it has sent or copied it. Engines also accept a plain state dict
    (:func:`weight_stream` wraps it).

    Args:
        metadata: What iteration yields, element for element, in order.
        produce: A fresh iterator over the pairs, called once per pass.
    """

    def __init__(self, metadata: Sequence[TensorMeta], produce: Callable[[], Iterator[tuple[str, torch.Tensor]]]):
        self._metadata = list(metadata)
        self._produce = produce

    def metadata(self) -> list[TensorMeta]:
        return list(self._metadata)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self._produce()

    def __len__(self) -> int:
        return len(self._metadata)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One pass, as a state dict's ``items()`` (for engines written against state dicts)."""
        return iter(self)

    def names(self) -> list[str]:
        """The names, in order, without producing a tensor (``dict(stream)`` makes one pass into a state dict)."""
        return [meta.name for meta in self._metadata]

    @classmethod
    def of(cls, state_dict: Mapping[str, torch.Tensor]) -> WeightStream:
        """A stream over an existing state dict (its tensors, never copies)."""
        metadata = [TensorMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in state_dict.items()]
        return cls(metadata, lambda: iter(state_dict.items()))


def weight_stream(weights: Mapping[str, torch.Tensor] | WeightStream) -> WeightStream:
    """``weights`` as a :class:`WeightStream` (a state dict is wrapped, not copied)."""
    return weights if isinstance(weights, WeightStream) else WeightStream.of(weights)


def checkpoint_weights(directory: Path) -> WeightStream:
    """The weights of a ``save_pretrained`` checkpoint's ``*.safetensors`` files (θ_0 as the engines publish it).

    Raises:
        ValueError: If ``directory`` holds no ``*.safetensors`` weights.
    """
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(path))
    if not state:
        raise ValueError(f"{directory} holds no *.safetensors weights to publish as θ_0")
    return WeightStream.of(state)


class RolloutEngineError(RuntimeError):
    """The engine can no longer serve: a replica died, failed to start, or did not acknowledge a publication.

    Raised by ``submit``/``generate``/``publish`` and set on the futures of requests that can no longer finish.
    An engine that raised it stays unusable (its replicas might serve different versions): close it, start another.
    """


def validate_request(request: GenerationRequest, vocab_size: int | None = None) -> None:
    """Raise one :class:`ValueError` naming every problem with ``request`` (checked at ``submit``, before queueing).

    Args:
        request: The request to check.
        vocab_size: The model's vocabulary size; when given, every prompt id must be below it.
    """
    problems = []
    if not request.prompt_token_ids:
        problems.append("prompt_token_ids is empty (give at least one token of context)")
    elif min(request.prompt_token_ids) < 0 or (vocab_size is not None and max(request.prompt_token_ids) >= vocab_size):
        problems.append(f"prompt_token_ids must lie in [0, {vocab_size or 'vocab_size'})")
    if request.max_tokens < 1:
        problems.append(f"max_tokens must be >= 1, got {request.max_tokens}")
    if not request.temperature > 0:
        problems.append(f"temperature must be > 0 (sampling, never greedy), got {request.temperature}")
    if not 0 <= request.seed < 2**63:
        problems.append(f"seed must be in [0, 2**63) (see sampling_seed), got {request.seed}")
    if problems:
        raise ValueError(f"Invalid GenerationRequest {request.request_id!r}: " + "; ".join(problems) + ".")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the agent loop and the learner need from a rollout engine.

    ``publish`` receives a state dict (name → full tensor), unless the engine sets ``accepts_weight_stream = True``:
    it then receives a :class:`WeightStream` (one tensor at a time, no staged copy of the model), as tslightning's
    engines do.
    """

    @property
    def policy_version(self) -> int:
        """Version of the weights every replica serves now."""

    def submit(self, request: GenerationRequest) -> Future[Generation]:
        """Queue one request; the future resolves to its :class:`Generation`."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """Blocking convenience: submit all, wait for all, in request order."""

    def publish(self, weights: Mapping[str, torch.Tensor] | WeightStream, policy_version: int) -> PublishReceipt:
        """Install new weights (a state dict, or a :class:`WeightStream` iterated once per receiver) on every
        replica; returns after every replica acknowledged ``policy_version``."""

    def close(self) -> None:
        """Stop replicas and free their resources."""


class QueuedEngine:
    """What the in-process engines share: requests answered through futures, the acknowledged policy version, and one
    usability state — after a failure or ``close`` every call raises :class:`RolloutEngineError`.

    Subclasses set ``_policy_version``, ``_failure`` (``None`` while healthy) and ``_closed`` in ``__init__`` and
    implement ``_submit`` (validate and queue a list of requests, one future each) and ``close``.
    """

    accepts_weight_stream = True
    """``publish`` takes a :class:`WeightStream` (the publisher then never stages a copy of the model)."""

    _policy_version: int
    _failure: str | None
    _closed: bool

    @property
    def policy_version(self) -> int:
        """Version every replica has acknowledged."""
        return self._policy_version

    def submit(self, request: GenerationRequest) -> Future[Generation]:
        """Queue one request; the future resolves to its :class:`Generation`."""
        return self._submit([request])[0]

    def generate(self, requests: Sequence[GenerationRequest], timeout: float | None = None) -> list[Generation]:
        """Submit all requests at once (so they can share batches), wait for all, in request order."""
        return [future.result(timeout) for future in self._submit(list(requests))]

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _submit(self, requests: list[GenerationRequest]) -> list[Future[Generation]]:
        raise NotImplementedError

    def _raise_if_unusable(self) -> None:
        if self._failure is not None:
            raise RolloutEngineError(self._failure)
        if self._closed:
            raise RolloutEngineError("The rollout engine is closed.")

    def _check_next_version(self, policy_version: int) -> None:
        """Refuse a publication that does not advance the version, and any publication to an unusable engine."""
        if policy_version <= self._policy_version:
            raise ValueError(f"policy_version must increase: {policy_version} <= {self._policy_version}.")
        self._raise_if_unusable()
