"""A plain GRPO LightningModule trained by a plain Lightning ``Trainer``, with all seven tslightning callbacks.

    python examples/grpo_trainer.py --out runs/example-trainer --updates 4
    python examples/grpo_trainer.py --out runs/example-trainer --updates 6 \
        --resume runs/example-trainer/checkpoints/update-3.ckpt

The module is ordinary Lightning: automatic optimization, ``self.log``, one optimizer step per batch — so one batch is
one update. Each ``training_step`` samples a group of completions per prompt from the rollout engine (the weights the
engine serves: θ_k, published after the previous step), scores them, and returns the GRPO loss. What the callbacks
read of it (see :mod:`tslightning.callbacks.update_callback`): ``policy`` (the model the engine serves),
``service_log`` (one :class:`~tslightning.ServiceRecord` per sampled trajectory, with the version that sampled it) and
``flops_per_batch`` (as Lightning's ``ThroughputMonitor`` reads it). The callbacks log through ``self.log``'s logger
connector: their metrics are in ``trainer.callback_metrics`` and one CSV row per update.
"""

from __future__ import annotations

import argparse
import sys
import time
import zlib
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, str(Path(__file__).parent))
from local_rollout import LocalEngine, build_policy, prompts_for_update, reward  # noqa: E402

from tslightning import ServiceRecord  # noqa: E402
from tslightning.callbacks import (  # noqa: E402
    BatchBarrier,
    GPUClockCheckpoint,
    GradientClipping,
    MFUMonitor,
    ReleaseTraceRecorder,
    StalenessMonitor,
    WeightPublisher,
)

CPU_PEAK_FLOPS = 1e11  # one CPU core's fp32 peak, roughly; Lightning's table has no entry for CPUs


class GRPOModule(L.LightningModule):
    """GRPO with group-normalized advantages (population std, Eq. 6) and 1/(P·L_i) token weights.

    Args:
        policy: The causal LM being trained; the engine serves its published weights.
        tokenizer: Its tokenizer.
        engine: Samples completions from the served weights (``sample``) and takes publications.
        prompts_per_update: P, groups per update.
        group_size: m, completions per prompt.
        max_new_tokens: Tokens sampled per completion.
        lr: AdamW learning rate.
    """

    def __init__(self, policy, tokenizer, engine, prompts_per_update=2, group_size=4, max_new_tokens=6, lr=1e-3):
        super().__init__()
        self.policy = policy
        self.tokenizer, self.engine = tokenizer, engine
        self.prompts_per_update, self.group_size, self.max_new_tokens, self.lr = (
            prompts_per_update,
            group_size,
            max_new_tokens,
            lr,
        )
        self.service_log: list[ServiceRecord] = []
        self.flops_per_batch: float | None = None
        self._parameters_count = sum(p.numel() for p in policy.parameters())

    def training_step(self, update: int, batch_idx: int) -> torch.Tensor:
        version = self.engine.policy_version  # θ_k, published after the previous step
        prompts = prompts_for_update(self.tokenizer, int(update), self.prompts_per_update)
        loss, records, rewards, tokens = torch.zeros(()), [], [], 0
        for group, prompt in prompts.items():
            seeds = [zlib.crc32(f"{group}/{i}".encode()) for i in range(self.group_size)]  # by identity, not order
            samples = [self.engine.sample(prompt, self.max_new_tokens, seed) for seed in seeds]
            scores = torch.tensor([reward(s) for s in samples], dtype=torch.float64)
            advantages = (scores - scores.mean()) / (scores.std(correction=0) + 1e-6)
            for i, completion in enumerate(samples):
                start = time.perf_counter()
                ids = torch.tensor([prompt + completion])
                logits = self.policy(input_ids=ids).logits[0, len(prompt) - 1 : -1]
                logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[0, len(prompt) :, None]).sum()
                weight = float(advantages[i]) / (self.group_size * self.prompts_per_update * len(completion))
                loss = loss - weight * logp
                records.append(
                    ServiceRecord(
                        "TrajectorySource",
                        group,
                        i,
                        None,
                        version,
                        ids.numel(),
                        len(completion),
                        start,
                        time.perf_counter(),
                    )
                )
                tokens += ids.numel()
            rewards += scores.tolist()
        self.service_log = records
        self.flops_per_batch = 6.0 * self._parameters_count * tokens  # forward 2N + backward 4N FLOPs per token
        self.log("train/reward", sum(rewards) / len(rewards), prog_bar=True, batch_size=len(rewards))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.policy.parameters(), lr=self.lr)


class Updates(IterableDataset):
    """The update indices still to run: from the Trainer's global step (restored by ``ckpt_path``) to ``updates``."""

    def __init__(self, module: L.LightningModule, updates: int) -> None:
        self.module, self.updates = module, updates

    def __iter__(self):
        yield from range(self.module.trainer.global_step, self.updates)


def callbacks(engine: LocalEngine, out: Path, checkpoint_every_s: float) -> list[L.Callback]:
    """The seven callbacks, in an order they check: readers of the publication after the publisher, the GPU-clock
    checkpoint last; and Lightning's ModelCheckpoint, which monitors a metric one of them logs."""
    return [
        BatchBarrier(),  # zero staleness: every trajectory of update k was sampled by θ_k
        GradientClipping(max_norm=1.0),
        WeightPublisher(engine),
        StalenessMonitor(max_policy_lag=0),
        MFUMonitor(available_flops=CPU_PEAK_FLOPS),
        ReleaseTraceRecorder(out / "trace"),
        GPUClockCheckpoint(out / "checkpoints", interval_s=checkpoint_every_s, keep_last=None),
        ModelCheckpoint(dirpath=out / "best", monitor="actor/grad_norm", mode="min", save_top_k=1),
    ]


def main(argv: list[str] | None = None) -> L.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/example-trainer"))
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--resume", type=str, default=None, help="an update-<k>.ckpt to resume from")
    parser.add_argument("--checkpoint-every-s", type=float, default=1e-9, help="GPU-clock seconds between checkpoints")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a small CPU
    policy, tokenizer = build_policy()
    engine = LocalEngine(policy)
    module = GRPOModule(policy, tokenizer, engine)
    trainer = L.Trainer(
        max_steps=args.updates,
        max_epochs=-1,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(args.out, name="csv"),
        log_every_n_steps=1,
        callbacks=callbacks(engine, args.out, args.checkpoint_every_s),
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    loader = DataLoader(Updates(module, args.updates), batch_size=None)
    trainer.fit(module, train_dataloaders=loader, ckpt_path=args.resume)
    return trainer


if __name__ == "__main__":
    main()
