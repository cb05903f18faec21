"""Start one vLLM server the ``vllm_server`` engine can train against, on a policy checkpoint, and keep it running.

    .venv/bin/python scripts/serve_policy.py --model runs/decode-tail-policy/policy-0 --port 8123 --cpus 0
    .venv/bin/python scripts/serve_policy.py --model runs/decode-tail-policy/policy-0 --port 8124 --cpus 0 \\
        --speculative '{"method": "ngram"}'      # rollout.speculative's settings (the run must name the same)

The command line is :func:`tslightning.rollout.vllm_server.check.server_command`'s (weight-sync routes, token-in/out
generation, log-probs of the sampling distribution, the gloo weight-transfer backend on CPU; with ``--speculative``
the drafter, its batch-size schedule and per-request acceptance counts). ``--cpus`` pins every process of the server
to those cores (``taskset``) and vLLM's CPU threads to them, as the benchmarks run it beside a learner on other cores.
It prints the server's URL once it answers, then waits; Ctrl-C (or SIGTERM) stops the server and its children.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from tslightning.rollout.speculative import SpeculativeSettings
from tslightning.rollout.vllm_server.check import server_command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the policy checkpoint (a fit run's <out_dir>/policy-0)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--cpus", default=None, help="cores for the whole server, e.g. 0 or 0,1 (default: any)")
    parser.add_argument("--speculative", default=None, help='rollout.speculative as JSON, e.g. \'{"method": "ngram"}\'')
    parser.add_argument("--kv_cache_bytes", type=int, default=256 * 2**20, help="KV cache of a CPU server")
    parser.add_argument("--max_model_len", type=int, default=4096)
    parser.add_argument("--log", default=None, help="write the server's output here (default: this terminal)")
    args = parser.parse_args()
    if not Path(args.model, "config.json").is_file():
        parser.error(
            f"--model {args.model} holds no config.json: give a checkpoint directory (e.g. <out_dir>/policy-0)"
        )
    speculative = SpeculativeSettings(**json.loads(args.speculative)) if args.speculative else None
    if speculative is not None and speculative.problems():
        parser.error("; ".join(speculative.problems()))
    extra = ["--kv-cache-memory-bytes", str(args.kv_cache_bytes), "--enforce-eager"]
    command, environment = server_command(
        args.model, args.port, host=args.host, python=sys.executable, max_model_len=args.max_model_len,
        extra=extra, speculative=speculative,
    )  # fmt: skip
    if args.cpus is not None:
        if shutil.which("taskset") is None:
            parser.error("--cpus needs taskset (util-linux)")
        command = ["taskset", "-c", args.cpus, *command]
        environment["VLLM_CPU_OMP_THREADS_BIND"] = args.cpus
    output = open(args.log, "w") if args.log else None  # noqa: SIM115 - held for the server's lifetime
    server = subprocess.Popen(
        command, env={**os.environ, **environment}, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )
    stop = lambda *_: (os.killpg(server.pid, signal.SIGTERM), server.wait(30), sys.exit(0))  # noqa: E731
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    url = f"http://{args.host}:{args.port}"
    while server.poll() is None:
        try:
            if requests.get(f"{url}/v1/models", timeout=2).status_code == 200:
                print(f"serving {args.model} at {url}", flush=True)
                break
        except requests.RequestException:
            time.sleep(1)
    sys.exit(server.wait())


if __name__ == "__main__":
    main()
