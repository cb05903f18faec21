"""One replica process of :class:`~tslightning.rollout.hf.engine.HFRolloutEngine`: loads the model, then serves its
inbox in order — ``generate`` batches (left-padded, each request sampled from its own seeded ``torch.Generator``, with
multi-turn prefix reuse from :class:`~tslightning.rollout.hf.prefix_cache.PrefixKVCache`), ``load`` (install the shared
weights of a version and acknowledge) and ``stop``.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections import deque
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import transformers
from transformers.cache_utils import DynamicLayer

from tslightning.rollout.core_placement import place_this_thread
from tslightning.rollout.engine import Generation, GenerationRequest
from tslightning.rollout.hf.prefix_cache import LayerKV, PrefixKVCache


def replica_main(
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
