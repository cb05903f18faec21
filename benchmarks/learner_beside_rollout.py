"""How much does running rollouts beside the learner slow the learner's passes?

Times the same learner work — forward and ``autograd.grad`` of a fixed set of sequences on the bench policy's
architecture, on the learner's core — in three conditions, interleaved round by round so that a drift of the
machine's speed reaches every condition alike:

* ``idle``: no rollout at all (what the ``sync`` schedule's learner sees after its rollout has finished);
* ``thread``: the bench workload's rollouts running in *this* process (agent loop, tokenization and engine client
  in threads on the rollout core, the replica in its own process), as ``tslightning fit`` runs them; the learner
  shares the GIL with the agent loop;
* ``process``: the same rollouts driven from a separate process: no GIL shared with the learner.

``thread`` vs ``process`` isolates the agent loop's GIL contention; ``process`` vs ``idle`` the interference of the
rollout's computation with the learner's on the shared machine (caches, memory bandwidth, the host).

Usage::

    .venv/bin/python benchmarks/learner_beside_rollout.py --config configs/bench_balanced.yaml --rounds 3

Prints each condition's median pass time per round and the ratios to ``idle``. Timing figures live here, never in
unit tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import yaml

from tslightning.loop.settings import RolloutSettings
from tslightning.loop.startup import rollout_datamodule, start_engine
from tslightning.loop.task_selection import training_tasks
from tslightning.models.tiny_model import TinyModelConfig, load_tiny_model, save_tiny_model
from tslightning.tasks.simulated_tool import SimulatedToolSettings

CONDITIONS = ("idle", "thread", "process")


def rollout_settings(config: dict) -> RolloutSettings:
    rollout = dict(config["rollout"])
    rollout["simulated_tool"] = SimulatedToolSettings(**rollout.get("simulated_tool", {}))
    return RolloutSettings(**rollout)


def roll_out(config: dict, policy_dir: str, warm, stop) -> None:
    """Run the config's GRPO rollouts update after update until ``stop``; set ``warm`` after the first update."""
    settings = rollout_settings(config)
    if settings.cpus is not None:
        os.sched_setaffinity(0, settings.cpus)  # in a thread: this thread (and the threads it starts) only
    _, tokenizer = load_tiny_model(policy_dir)
    engine = start_engine(settings, Path(policy_dir), "float32")
    datamodule = rollout_datamodule(
        settings, engine, tokenizer, training_tasks(settings), "grpo", None, config.get("seed", 0)
    )
    update = 0
    try:
        while not stop.is_set():
            for _ in datamodule.stream_update(update):
                pass
            update += 1
            warm.set()
    finally:
        engine.close()


def learner_sequences(policy, count: int, lengths: tuple[int, int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1], (count,), generator=generator)
    return [torch.randint(0, policy.config.vocab_size, (1, int(n)), generator=generator) for n in sizes]


def learner_pass(policy, sequences: list[torch.Tensor]) -> float:
    """Seconds for one forward + ``autograd.grad`` per sequence (the thundersync learner's per-source work)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    start = time.perf_counter()
    for tokens in sequences:
        loss = policy(tokens).logits.log_softmax(-1).mean()
        torch.autograd.grad(loss, params)
    return time.perf_counter() - start


def measure(condition: str, config: dict, policy_dir: str, policy, sequences, passes: int) -> float:
    """Median pass time with rollouts in ``condition``."""
    worker = None
    if condition == "thread":
        warm, stop = threading.Event(), threading.Event()
        worker = threading.Thread(target=roll_out, args=(config, policy_dir, warm, stop), daemon=True)
    elif condition == "process":
        context = mp.get_context("spawn")
        warm, stop = context.Event(), context.Event()
        worker = context.Process(target=roll_out, args=(config, policy_dir, warm, stop))
    if worker is not None:
        worker.start()
        if not warm.wait(timeout=600):
            raise RuntimeError(f"{condition}: the rollout did not finish its first update within 600 s")
    times = [learner_pass(policy, sequences) for _ in range(passes)]
    if worker is not None:
        stop.set()
        worker.join(timeout=600)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/bench_balanced.yaml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=5, help="timed learner passes per condition and round")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--min_tokens", type=int, default=150)
    parser.add_argument("--max_tokens", type=int, default=450)
    args = parser.parse_args()
    config = yaml.safe_load(Path(args.config).read_text())
    learner_cpus = (config.get("learner") or {}).get("cpus")
    if learner_cpus:
        os.sched_setaffinity(0, learner_cpus)
        torch.set_num_threads(len(learner_cpus))
    workdir = Path(tempfile.mkdtemp(prefix="learner-beside-rollout-"))
    tiny = TinyModelConfig(**config["model"]["tiny"], seed=config.get("seed", 0))
    source = save_tiny_model(workdir / "tiny", tiny)
    policy, tokenizer = load_tiny_model(source)
    policy_dir = workdir / "policy"
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    sequences = learner_sequences(policy, args.sequences, (args.min_tokens, args.max_tokens), seed=0)
    learner_pass(policy, sequences)  # warm the allocator and kernels
    results: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    for round_ in range(args.rounds):
        order = CONDITIONS if round_ % 2 == 0 else CONDITIONS[::-1]
        for condition in order:
            seconds = measure(condition, config, str(policy_dir), policy, sequences, args.passes)
            results[condition].append(seconds)
            print(f"round {round_} {condition:<8} median pass {seconds:.3f} s", flush=True)
    idle = statistics.mean(results["idle"])
    for condition in CONDITIONS:
        mean = statistics.mean(results[condition])
        print(f"{condition:<8} mean of round medians {mean:.3f} s  x idle {mean / idle:.3f}", flush=True)


if __name__ == "__main__":
    main()
