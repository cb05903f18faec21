"""One token-in/token-out turn on a vLLM server (``POST /inference/v1/generate``): the request body, and the answer
checked against the policy version (and adapter) the engine sent it at — no token sampled by another policy passes.
A speculating server is asked for no log-probs (it would report drafted tokens' wrongly); its answer's acceptance
counts become the generation's :class:`~tslightning.rollout.speculative.SpeculationStats`.
"""

from __future__ import annotations

from typing import Any

from tslightning.rollout.engine import Generation, GenerationRequest, RolloutEngineError
from tslightning.rollout.speculative import SpeculationStats

__all__ = ["checked_generation", "generate_body"]


def generate_body(
    request: GenerationRequest, request_id: str, model: str | None = None, logprobs: bool = True
) -> dict[str, Any]:
    """The body of ``request`` sent as ``request_id`` (unique among requests in flight), naming adapter ``model``;
    ``logprobs``: ask for the sampled tokens' log-probs (not from a speculating server)."""
    return {
        **({} if model is None else {"model": model}),  # the adapter of the request's version
        "request_id": request_id,
        "token_ids": list(request.prompt_token_ids),
        "sampling_params": {
            "max_tokens": request.max_tokens,
            "seed": request.seed,
            "temperature": request.temperature,
            "top_p": 1.0,
            "top_k": 0,  # 0 disables top-k in this vLLM
            "stop_token_ids": list(request.stop_token_ids),
            "ignore_eos": True,  # stop only on the request's stop tokens, like the other engines
            "logprobs": 0 if logprobs else None,  # 0: just the sampled token's log-prob
            "detokenize": False,
        },
    }


def checked_generation(
    request: GenerationRequest,
    answer: dict[str, Any],
    version: int,
    model: str | None,
    url: str,
    logprobs: bool = True,
) -> Generation:
    """The :class:`Generation` in ``answer``, refused unless every token was sampled at ``version`` (with the adapter
    ``model``, when one is served); ``logprobs``: the answer carries them (else the generation's are ``None``)."""
    if model is not None and answer.get("model") != model:
        raise RolloutEngineError(
            f"vLLM server {url} sampled {request.request_id!r} with {answer.get('model')!r}, but the engine had "
            f"published adapter {model!r} (version {version}): refusing tokens of another policy"
        )
    choice = answer["choices"][0]
    ids = tuple(choice["token_ids"])
    spans = choice.get("weight_versions") or []
    versions = sorted({span["version"] for span in spans})
    covered = sum(span["end"] - span["start"] for span in spans)
    if versions != [str(version)] or covered != len(ids):
        raise RolloutEngineError(
            f"vLLM server {url} sampled {request.request_id!r} at weight version(s) {versions} (spans {spans}), but "
            f"the engine had published version {version}: refusing tokens of another policy (is another trainer "
            "publishing to this server?)"
        )
    if choice["finish_reason"] not in ("stop", "length"):
        raise RolloutEngineError(f"vLLM server {url} finished {request.request_id!r} with {choice['finish_reason']!r}")
    speculation = SpeculationStats.from_metrics(answer.get("metrics"))
    if not logprobs:
        return Generation(request.request_id, ids, None, choice["finish_reason"], version, speculation=speculation)
    content = choice["logprobs"]["content"]
    if [entry["token_id"] for entry in content] != list(ids):
        raise RolloutEngineError(f"vLLM server {url} returned log-probs of other tokens for {request.request_id!r}")
    sampled = tuple(float(entry["logprob"]) for entry in content)
    return Generation(request.request_id, ids, sampled, choice["finish_reason"], version, speculation=speculation)
