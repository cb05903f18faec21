"""A Fabric loop around the StreamingPolicyModule, with all seven tslightning callbacks.

    python examples/streaming_fabric.py --out runs/example-fabric --updates 4
    python examples/streaming_fabric.py --out runs/example-fabric --updates 6 \\
        --resume runs/example-fabric/checkpoints/update-3

Each update's rollout yields stream items as they become ready — the update's ``BatchPlan``, each trajectory once its
reward is fixed, each ``GroupClosed``, then ``BatchClosed`` — and the module serves each trajectory's backward the
moment it arrives (``thundersync``), folding it into exact running statistics; at ``BatchClosed`` its barrier takes
the one optimizer step of the update. The loop is the one any Fabric user writes, plus the callback hooks, called by
keyword (Fabric passes each callback only the names its hook takes):

* ``on_train_start`` / ``on_train_end`` around the loop;
* ``on_train_batch_start`` / ``on_train_batch_end`` around each stream item (one item per ``training_step`` call);
* ``on_before_optimizer_step`` fires inside the barrier (the module's ``training_step`` calls it under Fabric);
* after each update, ``write_update_row(fabric)`` writes the update's one row of metrics (the callbacks' and this
  loop's).
"""

from __future__ import annotations

import argparse
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).parent))
from local_rollout import LocalEngine, build_policy, prompts_for_update, reward  # noqa: E402

from tslightning import (  # noqa: E402
    BatchClosed,
    BatchPlan,
    GroupClosed,
    OptimizerSettings,
    StreamingPolicyModule,
    TrajectorySource,
)
from tslightning.callbacks import (  # noqa: E402
    BatchBarrier,
    GPUClockCheckpoint,
    GradientClipping,
    MFUMonitor,
    ReleaseTraceRecorder,
    StalenessMonitor,
    WeightPublisher,
    log_update_metrics,
    restore_checkpoint,
    write_update_row,
)

CPU_PEAK_FLOPS = 1e11  # one CPU core's fp32 peak, roughly; Lightning's table has no entry for CPUs


def rollout(engine: LocalEngine, tokenizer, update: int, prompts: int, group_size: int, tokens: int) -> Iterator:
    """Update ``update``'s stream: its plan at the version the engine serves, then each trajectory as it finishes."""
    version = engine.policy_version
    groups = prompts_for_update(tokenizer, update, prompts)
    yield BatchPlan("grpo", version, {group: group_size for group in groups})
    for group, prompt in groups.items():
        for index in range(group_size):
            completion = engine.sample(prompt, tokens, seed=zlib.crc32(f"{group}/{index}".encode()))
            mask = torch.tensor([False] * len(prompt) + [True] * len(completion))
            token_ids = torch.tensor(prompt + completion)
            yield TrajectorySource(group, index, token_ids, mask, reward(completion), version, len(prompt))
        yield GroupClosed(group)
    yield BatchClosed(version)


def callbacks(engine: LocalEngine, out: Path, checkpoint_every_s: float, seed: int) -> list[L.Callback]:
    """The seven callbacks, in an order they check: readers of the publication after the publisher, the GPU-clock
    checkpoint last."""
    return [
        BatchBarrier(),  # the step only for a complete logical batch, every source sampled by θ_k
        GradientClipping(max_norm=1.0),  # the module is built with max_grad_norm=None
        WeightPublisher(engine),
        StalenessMonitor(max_policy_lag=0),
        MFUMonitor(available_flops=CPU_PEAK_FLOPS),  # FLOPs from the architecture and each source's tokens
        ReleaseTraceRecorder(out / "trace"),
        GPUClockCheckpoint(out / "checkpoints", interval_s=checkpoint_every_s, keep_last=None, seed=seed),
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/example-fabric"))
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--resume", type=str, default=None, help="an update-<k> checkpoint directory")
    parser.add_argument("--checkpoint-every-s", type=float, default=1e-9, help="GPU-clock seconds between checkpoints")
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=6)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a small CPU
    policy, tokenizer = build_policy()
    engine = LocalEngine(policy)
    installed = callbacks(engine, args.out, args.checkpoint_every_s, seed=0)
    loggers = [CSVLogger(args.out, name="csv")]
    fabric = L.Fabric(accelerator="cpu", devices=1, loggers=loggers, callbacks=list(installed))
    fabric.launch()
    module = StreamingPolicyModule(policy, "grpo", "thundersync", max_grad_norm=None, optimizer=OptimizerSettings(1e-3))
    _, optimizer = fabric.setup(module, module.configure_optimizers())
    first = 0
    if args.resume is not None:  # θ, AdamW, RNG, the policy version and every callback's state
        first = restore_checkpoint(args.resume, module, [optimizer], installed, fabric.global_rank, fabric).next_update

    fabric.call("on_train_start", trainer=fabric, pl_module=module)
    for update in range(first, args.updates):
        rewards = []
        for index, item in enumerate(rollout(engine, tokenizer, update, args.prompts, args.group_size, args.tokens)):
            fabric.call("on_train_batch_start", trainer=fabric, pl_module=module, batch=item, batch_idx=index)
            module.training_step(item, index)  # a trajectory's backward runs now; the barrier at BatchClosed
            fabric.call(
                "on_train_batch_end", trainer=fabric, pl_module=module, outputs=None, batch=item, batch_idx=index
            )
            rewards += [item.reward] if isinstance(item, TrajectorySource) else []
        log_update_metrics(fabric, module, {"train/reward": sum(rewards) / len(rewards)}, step=update)
        write_update_row(fabric)
    fabric.call("on_train_end", trainer=fabric, pl_module=module)
    for logger in fabric.loggers:
        logger.finalize("success")
    return {"fabric": fabric, "module": module, "engine": engine, "callbacks": installed}


if __name__ == "__main__":
    main()
