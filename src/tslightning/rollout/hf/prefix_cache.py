"""Prefix K/V reuse for the ``hf`` rollout replica (what vLLM calls automatic prefix caching).

A multi-turn agent's next request is its previous context, the sampled action and the new observation: without reuse
every turn re-runs the prefill of the whole context, so a trajectory of T turns costs about T/2 full prefills. The
replica keeps each finished generation's keys and values (one policy version's, so :meth:`PrefixKVCache.clear` on
every weight load) and a later request whose prompt extends a kept sequence prefills only its new tokens.

The reuse is exact up to floating-point summation order: a key/value row depends only on the tokens before it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

LayerKV = tuple[torch.Tensor, torch.Tensor]
"""One layer's keys and values for one sequence, each ``[kv_heads, tokens, head_dim]``."""


class PrefixKVCache:
    """Keys/values of finished sequences, looked up by the longest kept sequence that prefixes a new prompt.

    Args:
        max_tokens: Most cached token positions kept in all; the least recently stored go first.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"PrefixKVCache: max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[int, ...], list[LayerKV]] = OrderedDict()
        self._tokens = 0
        self.hits = 0
        """Lookups that reused a kept prefix."""
        self.reused_tokens = 0
        """Prompt tokens whose prefill was skipped."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def tokens(self) -> int:
        """Token positions held now."""
        return self._tokens

    def store(self, token_ids: Sequence[int], layers: list[LayerKV]) -> None:
        """Keep ``layers`` (every layer's K/V of exactly ``token_ids``) for later prompts that extend it."""
        key = tuple(token_ids)
        if not key or len(key) > self.max_tokens:
            return
        if any(k.shape[1] != len(key) or v.shape[1] != len(key) for k, v in layers):
            raise ValueError(f"PrefixKVCache.store: K/V hold {layers[0][0].shape[1]} positions for {len(key)} tokens")
        self._drop(key)
        self._entries[key] = layers
        self._tokens += len(key)
        while self._tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def take(self, prompt_token_ids: Sequence[int]) -> tuple[int, list[LayerKV] | None]:
        """The longest kept sequence that is a proper prefix of the prompt: ``(its length, its K/V)``, or ``(0, None)``.

        The entry is removed: the request that extends it stores its own, longer sequence when it finishes. At least
        one prompt token is always left to prefill (it yields the first sampled token's logits).
        """
        prompt = tuple(prompt_token_ids)
        best = None
        for key in self._entries:
            if len(key) < len(prompt) and prompt[: len(key)] == key and (best is None or len(key) > len(best)):
                best = key
        if best is None:
            return 0, None
        layers = self._entries[best]
        self._drop(best)
        self.hits += 1
        self.reused_tokens += len(best)
        return len(best), layers

    def clear(self) -> None:
        """Forget everything (new weights make every kept K/V stale)."""
        self._entries.clear()
        self._tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        if key in self._entries:
            del self._entries[key]
            self._tokens -= len(key)
