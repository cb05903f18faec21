"""Sharded checkpoints written and resumed by 2 ranks through Fabric: the runs ``test_sharded_resume.py`` launches.

Run as ``python tests/distributed/resume_cases.py OUT STRATEGY PHASE`` (Fabric's launcher re-runs this command line
for rank 1). Every rank replays the same synthetic GRPO logical batches through ``fit``'s own update
(:func:`tslightning.loop.updates.one_update`) with a :class:`GPUClockCheckpoint` that writes every update, and saves
the full θ after every update to ``OUT/<strategy>/<phase>/rank<r>.pt``.

Phases: ``straight`` runs updates 0 .. UPDATES−1 from θ_0 (the uninterrupted run); ``resumed`` is a new process that
builds θ_0 again, restores ``OUT/<strategy>/straight/checkpoints/update-<RESUME_AFTER>`` — the state a run killed
after that update left — with ``fit``'s :func:`~tslightning.loop.resume.resume_from` (which also publishes the
restored θ to this rank's engine, here a recording one), and runs the remaining updates, writing its own checkpoints;
``resumed-one-rank`` does the same on one rank (FSDP2 only: its checkpoint reshards).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import torch
from multirank_cases import DTYPES, SHAPE, _set_up, _strategy, full_values, make_policy

from tslightning.callbacks import GPUClockCheckpoint
from tslightning.core.replay_batches import synthetic_grpo_batch
from tslightning.distributed.learner_strategy import LearnerSettings, learner_strategy
from tslightning.distributed.rank_assignment import split_replay_batch
from tslightning.learner.streaming_module import OptimizerSettings, StreamingPolicyModule
from tslightning.loop.resume import resume_from
from tslightning.loop.updates import one_update
from tslightning.models.tiny_model import TinyModelConfig, build_tiny_model, build_tokenizer

UPDATES = 4
RESUME_AFTER = 1
"""The straight run's checkpoint the resumed run starts from: written after update 1, i.e. killed after 2 updates."""


def batches() -> list:
    tokenizer = build_tokenizer()
    vocab = build_tiny_model(TinyModelConfig(seed=0), tokenizer).config.vocab_size
    generator = torch.Generator().manual_seed(23)
    return [synthetic_grpo_batch(vocab, k, generator, SHAPE) for k in range(UPDATES)]


class _RecordingEngine:
    """This rank's rollout engine: keeps what ``resume_from`` publishes."""

    def __init__(self) -> None:
        self.published: list[tuple[int, dict[str, torch.Tensor]]] = []

    def publish(self, state_dict, policy_version: int) -> None:
        self.published.append((policy_version, {n: t.detach().to("cpu", copy=True) for n, t in state_dict.items()}))


def run(out: Path, fabric, phase: str, dtype: torch.dtype) -> dict:
    """This rank's updates of ``phase``; the full θ after each (``thetas[k]``: after update k) and checkpoints."""
    module = StreamingPolicyModule(
        make_policy(dtype), "grpo", "thundersync", optimizer=OptimizerSettings(lr=1e-3), accumulator_dtype=dtype
    )
    optimizer = _set_up(fabric, module)
    record = {"theta0": full_values(module), "thetas": {}, "first": 0}
    if phase.startswith("resumed"):  # fit's own resume: restore, then every rank's engine serves the restored θ
        engine = _RecordingEngine()
        record["first"] = resume_from(
            str(out / "straight" / "checkpoints" / f"update-{RESUME_AFTER}"), fabric, module, optimizer, engine
        )
        record["restored"] = full_values(module)
        record["published"] = engine.published
    fabric.call("on_train_start", trainer=fabric, pl_module=module)
    for k, batch in enumerate(batches()):
        if k < record["first"]:
            continue
        share = split_replay_batch(batch, fabric.world_size)[1][fabric.global_rank]
        share = share.reordered(torch.Generator().manual_seed(100 * k + fabric.global_rank))
        one_update(fabric, module, optimizer, iter(share.stream()), k)
        record["thetas"][k] = full_values(module)
    fabric.call("on_train_end", trainer=fabric, pl_module=module)
    return record


def main(out: str, strategy: str, phase: str) -> None:
    import lightning as L

    target = Path(out) / strategy
    checkpointer = GPUClockCheckpoint(target / phase / "checkpoints", interval_s=1e-9, keep_last=None)
    if phase == "resumed-one-rank":  # FSDP2 only: torch.distributed.checkpoint reshards onto 1 rank
        devices = 1
        sharding = learner_strategy(LearnerSettings(devices=1, strategy=strategy, timeout_s=30), "cpu")
    else:
        devices, sharding = 2, _strategy(strategy)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=sharding, callbacks=[checkpointer])
    fabric.launch()
    try:
        record = run(target, fabric, phase, DTYPES[strategy])
    except Exception:
        record = {"crash": traceback.format_exc()}
    torch.save(record, target / phase / f"rank{fabric.global_rank}.pt")
    print(f"rank {fabric.global_rank}: {strategy} {phase} done", flush=True)
    import torch.distributed as dist

    if dist.is_initialized() and "crash" not in record:  # leave together (see multirank_cases._tear_down)
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
