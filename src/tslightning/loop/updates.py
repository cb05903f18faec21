"""One update under each schedule: ingest a logical batch's items as they arrive, the barrier, one optimizer step and
publication (``sync``/``thundersync``), its one-step-off variant (``async``), and the per-update record.

Callbacks are called by keyword (``fabric.call(hook, trainer=..., pl_module=..., ...)``): Fabric passes each
callback only the names its hook takes.
"""

from __future__ import annotations

import math
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed
from tslightning.distributed.collectives import control_all_reduce
from tslightning.distributed.rank_failure import reported_to_ranks
from tslightning.learner.update_log import log_update_metrics, write_update_row
from tslightning.measure.device_clock import synchronized_clock
from tslightning.rollout.rollout_datamodule import RolloutDataModule


@dataclass
class FitResult:
    """What one ``fit`` run did: per-update mean training reward, step time and direction norm, and where things were
    written."""

    mean_rewards: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    direction_norms: list[float] = field(default_factory=list)
    """Per update, the global norm of the batch direction before clipping (0: every group's rewards were equal)."""
    teacher_gaps: list[float] = field(default_factory=list)
    """OPD: per update, mean log π_T − log π_θk over the sampled action tokens."""
    peak_learner_memory_mb: float = 0.0
    """Peak learner memory: CUDA max allocated on a GPU, else this process's max resident set (MiB)."""
    out_dir: str = ""


@dataclass
class RolloutOutcome:
    """What one update's rollout gave this rank, for the per-update record (summed over ranks there).

    Attributes:
        rewards: This rank's trajectory rewards.
        teacher_gap: OPD: Σ (log π_T − log π_θk) over this rank's scored tokens (0 when unknown).
        teacher_tokens: How many tokens ``teacher_gap`` sums over (0: no gap to log).
        metrics: This rank's other rollout metrics (name → value), logged as they are.
        rewards_known: False when the batch cannot hold rewards (an OPD replay): no mean reward is logged.
    """

    rewards: list[float]
    teacher_gap: float = 0.0
    teacher_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    rewards_known: bool = True


def one_update(fabric, module, optimizer, stream: Iterator, update: int) -> None:
    """One logical batch: ingest ``stream``'s items as they arrive — every item ready at once together, the
    learner's backlog (``take_ready``, when the stream has it) — then the barrier, the step and publication."""
    waited = 0.0
    while True:
        before = time.perf_counter()
        with reported_to_ranks(update):  # this rank's rollout or ingest failing fails the update on every rank
            first = next(stream)
            waited += time.perf_counter() - before
            ready = [first, *ready_now(stream)]
            module.ingest_ready(ready)
        item = ready[-1]  # a plan comes alone; BatchClosed comes last
        # Keyword arguments: Fabric passes each callback only the names its hook takes (the module is one too).
        if isinstance(item, BatchPlan):
            fabric.call("on_train_batch_start", trainer=fabric, pl_module=module, batch=item, batch_idx=update)
        elif isinstance(item, BatchClosed):
            module.update_timings["rollout_wait_s"] = waited

            def before_step() -> None:
                fabric.call("on_before_optimizer_step", trainer=fabric, pl_module=module, optimizer=optimizer)

            module.barrier(optimizer, before_step=before_step)
            fabric.call(
                "on_train_batch_end",
                trainer=fabric,
                pl_module=module,
                outputs=module.last_update,
                batch=item,
                batch_idx=update,
            )
            return


def ready_now(stream: Iterator) -> list:
    """The items ``stream`` has ready now without waiting (its ``take_ready``; none for a plain iterator)."""
    take_ready = getattr(stream, "take_ready", None)
    return take_ready() if take_ready is not None else []


class Prefetch:
    """Runs one update's rollouts to completion on a background thread (the ``async`` schedule's overlap)."""

    def __init__(self, datamodule: RolloutDataModule, update: int) -> None:
        self.items: list = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(datamodule, update), daemon=True)
        self._thread.start()

    def _run(self, datamodule: RolloutDataModule, update: int) -> None:
        try:
            self.items.extend(datamodule.stream_update(update))
        except BaseException as error:  # re-raised in the loop
            self.error = error

    def result(self) -> list:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.items


def one_step_off_update(fabric, module, optimizer, datamodule, update: int, updates: int, batch: Prefetch):
    """Learn update k on the batch sampled from θ_{k−1} while batch k+1 is sampled from θ_k; publish θ_{k+1} only
    after that rollout finished, so every batch is sampled by a single policy version (App. D.4)."""
    before = time.perf_counter()
    items = batch.result()
    following = Prefetch(datamodule, update + 1) if update + 1 < updates else None
    module.update_timings["rollout_wait_s"] = time.perf_counter() - before
    for item in items:
        module.ingest(item)
        if isinstance(item, BatchPlan):
            fabric.call("on_train_batch_start", trainer=fabric, pl_module=module, batch=item, batch_idx=update)

    def before_step() -> None:
        fabric.call("on_before_optimizer_step", trainer=fabric, pl_module=module, optimizer=optimizer)

    module.barrier(optimizer, before_step=before_step)
    if following is not None:
        following.result()  # the overlapped rollout must finish before θ_{k+1} is published
    fabric.call(
        "on_train_batch_end",
        trainer=fabric,
        pl_module=module,
        outputs=module.last_update,
        batch=items[-1],
        batch_idx=update,
    )
    return following


def continuous_items(batches):
    """The next fully_async batch's items, fetched when the loop asks for the first (inside its failure report)."""
    yield from next(batches)


def rollout_outcome(datamodule: RolloutDataModule, update: int, schedule: str) -> RolloutOutcome:
    """This rank's rewards, OPD teacher gap and environment metrics of update ``update``'s rollout."""
    trajectories = datamodule.trajectories[update]
    rewards = [t.reward for t in trajectories if t.reward is not None]
    gap, tokens = map(sum, zip(*(t.teacher_gap() for t in trajectories), strict=True)) if trajectories else (0, 0)
    # this rank's attempts' waits for their environments: set-up on the rollout's critical path (prefetch hides it)
    metrics = {
        "rollout/environment_wait_s": datamodule.environment_seconds(update),
        "rollout/prefetched_environments": float(datamodule.prefetched_environments(update)),
    }
    if schedule == "fully_async":  # groups beyond the staleness bound are dropped, never trained silently
        metrics["staleness/dropped_groups"] = float(datamodule.dropped_groups)
    return RolloutOutcome(rewards, gap, int(tokens), metrics)


def record_update(fabric, module, outcome: RolloutOutcome, result: FitResult, update: int, start: float, bar) -> None:
    """Reward, step time and schedule metrics of one finished update, over every rank's share (a collective)."""
    known = float(outcome.rewards_known)
    totals = [sum(outcome.rewards), len(outcome.rewards), outcome.teacher_gap, outcome.teacher_tokens, known]
    totals = torch.tensor(totals, dtype=torch.float64)
    control_all_reduce(totals)  # every rank's share; host numbers go over gloo (NCCL rejects them)
    reward_sum, num_rewards, gap, tokens, known = totals.tolist()
    result.mean_rewards.append(reward_sum / max(num_rewards, 1) if known else math.nan)  # nan: none recorded
    result.step_seconds.append(synchronized_clock(fabric.device) - start)
    metrics = {"train/mean_reward": result.mean_rewards[-1]} if known else {}
    metrics |= outcome.metrics
    if tokens:  # OPD: mean log π_T − log π_θ of the sampled tokens (−reverse-KL estimate), rises toward 0
        metrics["train/teacher_logprob_gap"] = gap / tokens
        result.teacher_gaps.append(gap / tokens)
    if module.last_update is not None:
        result.direction_norms.append(module.last_update.direction_norm)
    if module.max_grad_norm is not None and module.last_update is not None:  # the module clipped (ZeRO, FSDP)
        metrics["actor/grad_norm"] = module.last_update.direction_norm
        metrics["actor/grad_clip_coef"] = module.last_update.clip_coefficient
    log_update_metrics(fabric, module, metrics, step=update)
    write_update_row(fabric)  # one row per update: the callbacks' metrics and these
    bar.set_postfix(reward=f"{result.mean_rewards[-1]:.3f}", step_s=f"{result.step_seconds[-1]:.1f}")


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
