"""Lossless speculative decoding for the rollout tail: the settings, the vLLM config they become, and what a
generation reports of it.

A few long trajectories decoding alone at the end of an update leave the engine nearly empty: each step emits one
token per sequence for the cost of a whole step. Speculative decoding with a model-free drafter (vLLM's ``ngram``
prompt lookup, or ``suffix`` decoding) proposes ``num_speculative_tokens`` continuations from text already in the
context, and the target model verifies them in one step with rejection sampling — the sampled tokens keep the
distribution π_θk exactly (standard rejection sampling at the request's temperature; never vLLM's lossy
``synthetic`` acceptance). With ``max_running_sequences`` set, speculation runs only while the engine holds at most
that many sequences (vLLM's dynamic speculative decoding), i.e. in the tail, where the engine has spare compute.

Two things are never trusted with speculation on: the log-probs an engine reports for drafted tokens (vLLM 0.32 on
CPU reports 0.0 for them), so generations carry none and nothing downstream reads them (the learner scores the
sampled ids itself); and a server whose drafter settings differ from the run's (:func:`speculative_problems`). The
CPU platform's sampler needs :mod:`~tslightning.rollout.vllm_engine.cpu_sampling` to be exact at all.

This module imports no vLLM: the settings parse and validate in any install.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["SpeculationStats", "SpeculativeSettings", "speculative_problems"]

_COMPARED = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
"""The served config's keys that must equal the run's (besides the batch-size schedule and rejection sampling)."""


@dataclass
class SpeculativeSettings:
    """Model-free, lossless speculative decoding on the ``vllm_server`` and ``vllm`` engines (``rollout.speculative``).

    The sampled distribution is unchanged; what changes is how many tokens one engine step yields when the drafts are
    right (text the policy copies from its context: file contents, paths, earlier commands).
    """

    method: Literal["ngram", "suffix"] = "ngram"
    """``ngram``: vLLM's prompt lookup (proposes what followed the last matching n-gram of the context); ``suffix``:
    suffix decoding over the request and earlier responses (needs the ``arctic-inference`` package where vLLM runs)."""
    num_speculative_tokens: int = 4
    """Draft tokens verified per engine step (k); one step yields 1 to k + 1 tokens."""
    prompt_lookup_max: int = 4
    """``ngram``: longest n-gram of the context's end matched against earlier context."""
    prompt_lookup_min: int = 2
    """``ngram``: shortest n-gram matched (1 drafts after any repeated token, and is rejected more often)."""
    max_running_sequences: int | None = 4
    """Speculate only while the engine runs at most this many sequences (the tail: vLLM's dynamic speculative
    decoding, ``num_speculative_tokens_per_batch_size``); ``None``: at every batch size."""

    def problems(self) -> list[str]:
        """Everything out of range, each naming the key (``rollout.speculative.*``) and the fix."""
        key = "rollout.speculative"
        problems = []
        if self.num_speculative_tokens < 1:
            problems.append(f"{key}.num_speculative_tokens must be >= 1; got {self.num_speculative_tokens}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            problems.append(
                f"{key}.prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max; got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )
        if self.max_running_sequences is not None and self.max_running_sequences < 1:
            problems.append(
                f"{key}.max_running_sequences must be >= 1, or null to speculate at every batch size; got "
                f"{self.max_running_sequences}"
            )
        return problems

    def batch_size_schedule(self) -> list[list[int]] | None:
        """vLLM's ``num_speculative_tokens_per_batch_size``: k up to ``max_running_sequences`` sequences, 0 above
        (``None``: no schedule, k at every batch size)."""
        if self.max_running_sequences is None:
            return None
        tail = self.max_running_sequences
        return [[1, tail, self.num_speculative_tokens], [tail + 1, tail + 1, 0]]

    def vllm_config(self) -> dict[str, Any]:
        """The ``speculative_config`` of a vLLM server (``--speculative-config``, JSON) or of ``vllm.LLM``."""
        config: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            config |= {"prompt_lookup_max": self.prompt_lookup_max, "prompt_lookup_min": self.prompt_lookup_min}
        schedule = self.batch_size_schedule()
        if schedule is not None:
            config["num_speculative_tokens_per_batch_size"] = schedule
        return config

    def server_flags(self) -> list[str]:
        """The ``api_server`` flags that start a server with these settings, per-request acceptance counts included
        (what the release trace records)."""
        import json

        return [
            "--speculative-config",
            json.dumps(self.vllm_config()),
            "--per-request-spec-decode-metrics",
            "summary",
        ]


def speculative_problems(
    url: str, config: Mapping[str, Any], settings: SpeculativeSettings | None, key: str = "rollout.server_urls"
) -> list[str]:
    """Each way the server at ``url`` (its ``/server_info`` ``vllm_config``) samples differently from the run's
    ``rollout.speculative`` ``settings``: another drafter or schedule, speculation where the run has none (or none
    where it has), lossy acceptance, or no per-request acceptance counts. One line each, naming the fix."""
    served = config.get("speculative_config") or None
    if settings is None:
        if served is None:
            return []
        return [
            f"{key}: {url} runs speculative decoding ({served.get('method')}) but rollout.speculative is not set: "
            f"restart it without --speculative-config, or set rollout.speculative to its settings"
        ]
    option, value, *metrics_flags = settings.server_flags()
    fix = f"restart it with {option} '{value}' {' '.join(metrics_flags)}"
    if served is None:
        return [f"{key}: {url} runs without speculative decoding, rollout.speculative asks for it: {fix}"]
    problems = []
    expected = settings.vllm_config()
    differing = [
        f"{name} {served.get(name)!r} (run: {expected.get(name)!r})"
        for name in _COMPARED
        if name in expected and served.get(name) != expected[name]
    ]
    schedule = served.get("num_speculative_tokens_per_batch_size")
    wanted = expected.get("num_speculative_tokens_per_batch_size")
    if ([list(entry) for entry in schedule] if schedule else None) != wanted:
        differing.append(f"batch-size schedule {schedule} (run: {wanted})")
    if differing:
        problems.append(f"{key}: {url} speculates with {', '.join(differing)}: {fix}")
    if served.get("rejection_sample_method", "standard") != "standard":
        problems.append(
            f"{key}: {url} accepts drafts with {served.get('rejection_sample_method')!r} rejection sampling, which "
            "does not keep the policy's distribution: restart it without rejection_sample_method (standard)"
        )
    metrics = (config.get("observability_config") or {}).get("per_request_spec_decode_metrics")
    if metrics in (None, "none"):
        problems.append(
            f"{key}: {url} reports no per-request acceptance counts (the release trace records them): restart it "
            "with --per-request-spec-decode-metrics summary"
        )
    return problems


@dataclass(frozen=True)
class SpeculationStats:
    """What speculative decoding did for one generation (vLLM's per-request ``speculative_decoding`` metrics).

    Attributes:
        steps: Verification steps that carried drafts.
        drafted: Draft tokens proposed over those steps.
        accepted: Draft tokens accepted (each step also yields one sampled token of its own).
    """

    steps: int
    drafted: int
    accepted: int

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    def __add__(self, other: SpeculationStats) -> SpeculationStats:
        return SpeculationStats(self.steps + other.steps, self.drafted + other.drafted, self.accepted + other.accepted)

    @classmethod
    def from_request_metrics(cls, stats: Any) -> SpeculationStats | None:
        """From an in-process completion's ``spec_decode_metrics`` (vLLM's ``RequestSpecDecodeMetrics``: a histogram
        whose entry j counts the steps that accepted j drafts), or ``None``."""
        if stats is None:
            return None
        accepted = sum(j * steps for j, steps in enumerate(stats.histogram))
        return cls(sum(stats.histogram), int(stats.num_draft_tokens), accepted)

    @classmethod
    def from_metrics(cls, metrics: Mapping[str, Any] | None) -> SpeculationStats | None:
        """From a ``/inference/v1/generate`` answer's ``metrics`` (``None`` when the server reported none)."""
        spec = (metrics or {}).get("speculative_decoding")
        if not spec:
            return None
        return cls(int(spec["num_spec_steps"]), int(spec["num_draft_tokens"]), int(spec["num_accepted_draft_tokens"]))
