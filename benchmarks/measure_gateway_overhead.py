"""What the gateway adds to a harness's model call: chat rendering, the continuation rule's tokenization of the new
text, HTTP and JSON, against an engine that answers at once (so the time is the gateway's own).

A conversation grows by one reply and one observation per call, as a harness sends it back; the first prompt is
mini-swe-agent's shipped one (~1,700 tokens of the tiny tokenizer) when ``--long`` is given, else a short one.

    .venv/bin/python benchmarks/measure_gateway_overhead.py [--calls 40] [--long]

Prints the median and 90th-percentile milliseconds per call (client round trip) and the prompt's length at the end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import Future

import openai

from tslightning.models.tiny_model import build_tokenizer
from tslightning.rollout.agent_loop import AgentLimits
from tslightning.rollout.engine import Generation, GenerationRequest
from tslightning.rollout.gateway import OpenAIGateway

REPLY = "```mswea_bash_command\nwc -l < log.txt > count.txt\n```"
OBSERVATION = "<returncode>0</returncode>\n<output>\n" + "line of output\n" * 20 + "</output>"


class InstantEngine:
    """Answers every request at once with the tokenizer's ids of :data:`REPLY`."""

    policy_version = 0

    def __init__(self, tokenizer) -> None:
        self.ids = tuple(tokenizer.encode(REPLY, add_special_tokens=False)) + (tokenizer.eos_token_id,)

    def submit(self, request: GenerationRequest) -> Future:
        future: Future = Future()
        future.set_result(Generation(request.request_id, self.ids, (-1.0,) * len(self.ids), "stop", 0))
        return future


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--long", action="store_true", help="a ~1,700-token first prompt (mini-swe-agent's own)")
    args = parser.parse_args()
    tokenizer = build_tokenizer()
    system = "You are a helpful assistant that can interact with a computer. " * (40 if args.long else 1)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Count the lines of log.txt."}]
    limits = AgentLimits(
        max_turns=args.calls, max_tokens_per_turn=64, max_tokens_per_trajectory=64 * args.calls,
        max_prompt_tokens=16384, max_context_tokens=131072,
    )  # fmt: skip
    with OpenAIGateway(InstantEngine(tokenizer), tokenizer, limits) as gateway:
        session = gateway.open_attempt("t", "g", 0, update=0)
        client = openai.OpenAI(base_url=gateway.base_url, api_key=session.key, max_retries=0)
        seconds = []
        for _ in range(args.calls):
            start = time.perf_counter()
            reply = client.chat.completions.create(model="tslightning-policy", messages=messages)
            seconds.append(time.perf_counter() - start)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
            messages += [{"role": "user", "content": OBSERVATION}]
        prompt = reply.usage.prompt_tokens
    ms = sorted(1000 * s for s in seconds)
    p90 = ms[int(0.9 * (len(ms) - 1))]
    print(f"{args.calls} calls: median {statistics.median(ms):.2f} ms, p90 {p90:.2f} ms; last prompt {prompt} tokens")


if __name__ == "__main__":
    main()
