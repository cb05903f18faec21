"""What both examples share: the tiny Qwen2 policy (built offline, no downloads), a local rollout engine that samples
from its own copy of the served weights, the prompts of each update and a verifiable reward.

The engine is the part a real project replaces (vLLM, the HF engine, a remote pool): tslightning's
:class:`~tslightning.callbacks.WeightPublisher` needs from it only ``policy_version`` and ``publish(weights, version)``
returning a receipt once every replica serves that version.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from tslightning.models.tiny_model import TinyModelConfig, build_tiny_model, build_tokenizer
from tslightning.rollout.engine import PublishReceipt, WeightStream, weight_stream

TASKS = (
    "count the lines of notes.txt",
    "print the largest number in data.csv",
    "list the files in /app sorted by size",
    "remove duplicate lines from words.txt",
    "show the last three lines of log.txt",
    "sum the second column of table.tsv",
)


def build_policy(seed: int = 0) -> tuple[torch.nn.Module, object]:
    """The tiny Qwen2 policy (float32) and its tokenizer, built offline."""
    tokenizer = build_tokenizer()
    return build_tiny_model(TinyModelConfig(seed=seed), tokenizer), tokenizer


def prompts_for_update(tokenizer, update: int, count: int) -> dict[str, list[int]]:
    """The ``count`` prompts of update ``update`` (group id → token ids), chosen by the update index alone, so a
    resumed run samples what an uninterrupted one would."""
    chosen = [(update * count + p) % len(TASKS) for p in range(count)]
    return {f"u{update}/p{p}": tokenizer.encode(TASKS[task]) for p, task in enumerate(chosen)}


def reward(completion: list[int]) -> float:
    """A verifiable reward: the fraction of even token ids in the completion (something GRPO can learn)."""
    return sum(token % 2 == 0 for token in completion) / len(completion)


class LocalEngine:
    """A one-replica rollout engine in this process: samples from a copy of the served weights."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.model = copy.deepcopy(policy).eval()
        self.policy_version = 0
        self.publications: list[int] = []

    def publish(self, weights: Mapping[str, torch.Tensor] | WeightStream, policy_version: int) -> PublishReceipt:
        """Serve ``weights`` (the publisher streams θ one full tensor at a time) from now on, as ``policy_version``."""
        served = self.model.state_dict()  # views of the served copy's tensors: written in place
        with torch.no_grad():
            for name, tensor in weight_stream(weights):
                served[name].copy_(tensor)
        self.policy_version = policy_version
        self.publications.append(policy_version)
        return PublishReceipt(policy_version, replicas=1, seconds=0.0)

    @torch.no_grad()
    def sample(self, prompt: list[int], max_new_tokens: int, seed: int) -> list[int]:
        """Sample ``max_new_tokens`` ids after ``prompt`` at temperature 1 (seeded: the same seed, the same ids)."""
        generator = torch.Generator().manual_seed(seed)
        ids = torch.tensor([prompt])
        for _ in range(max_new_tokens):
            logits = self.model(input_ids=ids).logits[0, -1].float()
            token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            ids = torch.cat([ids, token[None]], dim=1)
        return ids[0, len(prompt) :].tolist()

    def close(self) -> None:
        pass
