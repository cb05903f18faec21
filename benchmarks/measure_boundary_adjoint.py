"""Learner FLOPs and wall time of the context-recompute vs the boundary-adjoint context backward (App. I).

Runs the streaming module (thundersync) on the offline tiny Qwen2 in float32 on one thread, over
* one GRPO group of m trajectories sharing a long prompt (m = 4..8), and
* one OPD trajectory of several turns, each turn's history extending the previous one,
and prints, per group / trajectory, the learner FLOPs (App. B.1 accounting, :mod:`tslightning.measure.learner_flops`)
and the median learner service time (``update_timings["learner_service_s"]``: every source's backward and the deferred
context backward, not the barrier) for ``context_backward="recompute"`` and ``"boundary"``, and checks that both
take the same update direction.

Usage: .venv/bin/python benchmarks/measure_boundary_adjoint.py [--repeats 5] [--prompt 256] [--continuation 64]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import BatchClosed, GroupClosed, TrajectoryClosed, TrajectorySource, TurnSource
from tslightning.learner.streaming_module import OptimizerSettings, StreamingPolicyModule
from tslightning.measure.learner_flops import DecoderShape, boundary_flops, source_flops
from tslightning.models.tiny_model import TinyModelConfig, build_tiny_model, build_tokenizer


def grpo_group(vocab: int, m: int, prompt: int, continuation: int, gen: torch.Generator) -> list:
    """A one-group GRPO batch: m trajectories of ``prompt + continuation`` tokens, every continuation token scored."""
    shared = torch.randint(0, vocab, (prompt,), generator=gen)
    items: list = [BatchPlan(Objective.GRPO, 0, {"g": m})]
    for i in range(m):
        ids = torch.cat([shared, torch.randint(0, vocab, (continuation,), generator=gen)])
        mask = torch.arange(ids.numel()) >= prompt
        items.append(TrajectorySource("g", i, ids, mask, float(i % 3), 0, prompt))
    return [*items, GroupClosed("g"), BatchClosed(0)]


def opd_trajectory(vocab: int, turns: int, prompt: int, action: int, observation: int, gen: torch.Generator) -> list:
    """A one-trajectory OPD batch: turn j's history is turn j−1's, an observation, then ``action`` scored tokens."""
    history = torch.randint(0, vocab, (prompt,), generator=gen)
    items: list = [BatchPlan(Objective.OPD, 0, {"p": 1})]
    for j in range(turns):
        if j > 0:
            history = torch.cat([history, torch.randint(0, vocab, (observation,), generator=gen)])
        history = torch.cat([history, torch.randint(0, vocab, (action,), generator=gen)])
        mask = torch.arange(history.numel()) >= history.numel() - action
        teacher = -torch.rand(action, generator=gen) * 6
        items.append(TurnSource("p", 0, j, history, mask, teacher, 0))
    return [*items, TrajectoryClosed("p", 0, turns), GroupClosed("p"), BatchClosed(0)]


def run(policy, items: list, context_backward: str) -> tuple[StreamingPolicyModule, float]:
    # lr = 0: the barrier steps, but every run and mode sees the same θ (and so the same direction).
    settings = OptimizerSettings(lr=0.0)
    module = StreamingPolicyModule(
        policy, objective=items[0].objective, context_backward=context_backward, optimizer=settings
    )
    for item in items:
        module.ingest(item)
    service = module.update_timings["learner_service_s"]
    module.barrier(module.configure_optimizers())
    return module, service


def measure(policy, shape: DecoderShape, items: list, repeats: int) -> dict[str, tuple[int, float]]:
    """Per mode: (learner FLOPs, median service seconds); raises if the two directions differ."""
    results, directions = {}, {}
    for mode in ("recompute", "boundary"):
        run(policy, items, mode)  # warm-up
        times = []
        for _ in range(repeats):
            module, seconds = run(policy, items, mode)
            times.append(seconds)
        if mode == "recompute":
            flops = sum(source_flops(shape, s.token_ids.numel()).total for s in items if hasattr(s, "token_ids"))
        else:
            boundary = module.shared_prompts if module.objective is Objective.GRPO else module.turn_boundaries
            flops = boundary_flops(shape, boundary.passes).total
        results[mode] = (flops, statistics.median(times))
        directions[mode] = module.last_direction
    gap = float((directions["boundary"] - directions["recompute"]).norm() / directions["recompute"].norm())
    if gap > 1e-5:
        raise AssertionError(f"boundary and recompute directions differ: relative error {gap:.2e}")
    return results


def report(label: str, results: dict[str, tuple[int, float]]) -> None:
    (f_r, t_r), (f_b, t_b) = results["recompute"], results["boundary"]
    print(
        f"{label:<52} recompute {f_r / 1e9:8.3f} GFLOP {t_r * 1e3:8.1f} ms | boundary {f_b / 1e9:8.3f} GFLOP "
        f"{t_b * 1e3:8.1f} ms | FLOPs x{f_r / f_b:.2f} time x{t_r / t_b:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=256, help="GRPO prompt tokens (OPD: first turn's prompt)")
    parser.add_argument("--continuation", type=int, default=64, help="GRPO continuation tokens per trajectory")
    parser.add_argument("--action", type=int, default=32, help="OPD scored tokens per turn")
    parser.add_argument("--observation", type=int, default=32, help="OPD observation tokens between turns")
    args = parser.parse_args()
    torch.set_num_threads(1)
    policy = build_tiny_model(TinyModelConfig(seed=0), build_tokenizer()).float()
    shape = DecoderShape.from_config(policy.config)
    vocab = policy.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    print(f"tiny Qwen2 {shape}, float32, torch threads {torch.get_num_threads()}, median of {args.repeats}")
    for m in (4, 6, 8):
        items = grpo_group(vocab, m, args.prompt, args.continuation, gen)
        report(
            f"GRPO group m={m} prompt={args.prompt} cont={args.continuation}",
            measure(policy, shape, items, args.repeats),
        )
    for turns in (2, 4, 8):
        items = opd_trajectory(vocab, turns, args.prompt, args.action, args.observation, gen)
        label = f"OPD trajectory turns={turns} prompt={args.prompt} act={args.action} obs={args.observation}"
        report(label, measure(policy, shape, items, args.repeats))


if __name__ == "__main__":
    main()
