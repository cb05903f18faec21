"""Learner ranks for ``tslightning fit``: devices, nodes and the Fabric strategy that connects them.

Every learner rank rolls out its own share of each logical batch (:mod:`tslightning.distributed.rank_assignment`) with
its own rollout engine, streams those sources, and meets the other ranks at the barrier, where the batch direction is
all-reduced (Eq. 3). A rank that fails or dies fails the update on every rank within seconds, one that hangs within
its timeout (:mod:`tslightning.distributed.rank_failure`, :mod:`tslightning.distributed.failure_watch`).

Launching several ranks (Fabric's launchers; every rank runs the same command line):

* One machine: ``tslightning fit --config C --learner.devices 2 --learner.strategy ddp``. Fabric re-runs the
  command line for ranks 1..devices−1 (on CPU over gloo, on GPUs over NCCL).
* torchrun: ``torchrun --nnodes N --nproc-per-node D --rdzv-endpoint HOST:PORT -m tslightning.cli fit --config C
  --learner.devices D --learner.num_nodes N --learner.strategy ddp`` on every node; Fabric reads the ranks from
  torchrun's environment.
* SLURM: ``srun --nodes N --ntasks-per-node D tslightning fit --config C --learner.devices D --learner.num_nodes N
  --learner.strategy ddp`` inside an ``sbatch`` allocation; Fabric's SLURM environment reads ``SLURM_PROCID`` etc.

Strategies: ``ddp`` (replicated parameters), ``deepspeed_stage_2`` (ZeRO-2: partitioned optimizer state and
gradients; the direction reaches them through :mod:`tslightning.distributed.zero_gradients`; float32 at most —
DeepSpeed has no float64 model dtype) and ``deepspeed_stage_3`` (ZeRO-3: parameters partitioned too; every forward
gathers each layer in a collective, so the ranks serve their sources in lock-step ticks,
:mod:`tslightning.distributed.lockstep`, with the ``recompute`` context backward) stream exactly on several ranks;
their GPU-clock checkpoints are sharded, every rank writing its partition
(:mod:`tslightning.callbacks.checkpoint_layout`), and resume on the same strategy and number of ranks (FSDP2's
reshard onto any number). ``fsdp`` is FSDP2 (``fully_shard``, one unit per decoder block) through Fabric's
``ModelParallelStrategy`` (:mod:`tslightning.distributed.fsdp_gradients`; on CPU over gloo; a model the caller casts
to float64 runs under it, but Fabric has no ``64-true`` precision for it, so ``fit`` refuses that pair); like ZeRO-3
it serves sources in lock-step, and its checkpoints are sharded too.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from tslightning.objectives.chunked_head import DEFAULT_CHUNK_ROWS

StrategyName = Literal["auto", "ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"]


@dataclass
class LearnerSettings:
    """Learner ranks: ``devices`` per node × ``num_nodes``, connected by ``strategy``."""

    devices: int = 1
    """Learner ranks per node (processes; one GPU each on GPUs)."""
    num_nodes: int = 1
    """Nodes; launch one process per device on each (torchrun or SLURM, see the module docstring)."""
    strategy: StrategyName = "auto"
    """``auto`` (one rank: no strategy; several: ``ddp``), ``ddp``, ``deepspeed_stage_2`` (also on CPU, over gloo);
    ``deepspeed_stage_3`` and ``fsdp`` (FSDP2; both shard the parameters, serve sources in lock-step ticks and need
    ``context_backward=recompute``)."""
    timeout_s: float = 1800.0
    """Longest wait in a data collective (the default group's: gradient reductions, FSDP2 / ZeRO-3 gathers, NCCL's
    watchdog): a rank that hangs there fails the update after this. A rank that raises (out of memory included) or
    dies is heard within seconds instead (``heartbeat_timeout_s``), and NCCL collectives waiting for it are aborted;
    a gloo data collective (CPU learners) cannot be aborted and waits this long."""
    control_timeout_s: float = 14400.0
    """Longest wait in a control message (the barrier's agreement, lock-step ticks, publication outcomes), where a
    rank also waits for the other ranks' rollouts: a rank that hangs while alive fails the update after this."""
    heartbeat_timeout_s: float = 20.0
    """A rank whose heartbeat (every 0.5 s, over the rendezvous store) stops this long is dead: every other rank
    fails the update with ``RankFailureError`` (:mod:`tslightning.distributed.failure_watch`)."""
    process_group_backend: str | None = None
    """torch.distributed backend of the learner ranks' default group; ``None``: gloo on CPU, NCCL on GPUs (Fabric's
    choice). tslightning's own control messages always travel over gloo (a side group when this is not gloo)."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's inputs in a pass and recompute the layer in its backward (transformers'
    gradient checkpointing): far less activation memory for one more forward per pass (``tslightning plan``)."""
    statistics_device: Literal["auto", "host", "device"] = "auto"
    """Where the streaming statistics (GRPO G1/G2 of open groups and the batch accumulator; OPD's sum) live: the
    learner's ``device`` (no copies), or ``host`` memory (page-locked on GPUs; each gradient unit crosses through
    ``fold_queue_depth`` staging buffers, overlapped with the backward). ``auto``: the device when ``tslightning
    plan`` says the run fits there, else the host (on a CPU learner the two are the same memory)."""
    shard_statistics: bool = False
    """Under ``fsdp``: each rank keeps only its shard (FSDP2's dim-0 chunks) of every open group's G1/G2 and of the
    batch accumulator (or OPD's sum), ``(2·open + 1)·numel/world`` values (``open`` over all ranks) instead of
    ``(2·open + 1)·numel``; each gradient unit of every lock-step pass is sent shard by shard to the rank that keeps
    it as the backward produces it (:mod:`tslightning.distributed.statistics_shards`)."""
    fold_queue_depth: int = 0
    """Fold each gradient unit into the statistics (Eq. 7's axpys; with host statistics on a GPU, through one
    page-locked staging buffer each) on a background thread, at most this many units pending, while the backward
    produces the next; 0: fold on the learner thread as each unit completes. 2 (double buffering) suits host
    statistics on GPUs."""
    logprob_chunk_tokens: int = DEFAULT_CHUNK_ROWS
    """Most rows of logits the output head holds at a time when a pass scores tokens (the learner's passes and the
    in-process OPD teacher's): no pass builds T×V logits, only the scored rows reach the head, in chunks of this many,
    each recomputed in the backward. 1024 keeps a chunk's transient logits and log-softmax near 2.3 GiB at a 152k
    vocabulary and the head's matmul big enough for full GPU speed; lower it if that transient does not fit."""
    cpus: list[int] | None = None
    """CPU cores the learner process runs on, one torch thread each (``None``: unchanged); with ``rollout.cpus`` it
    places rollout and learner on separate cores, as the CPU benchmark does."""

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    def problems(self, schedule: str) -> list[str]:
        """Everything wrong with these settings for ``schedule``, each naming the key and the fix."""
        problems = []
        if self.devices < 1 or self.num_nodes < 1:
            problems.append(f"learner.devices and learner.num_nodes must be >= 1; got {self.devices}, {self.num_nodes}")
        for name in ("timeout_s", "control_timeout_s", "heartbeat_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"learner.{name} must be > 0 seconds; got {getattr(self, name)}")
        if isinstance(self.fold_queue_depth, bool) or self.fold_queue_depth < 0:
            problems.append(
                f"learner.fold_queue_depth must be an int >= 0 (0: fold on the learner thread); got "
                f"{self.fold_queue_depth}"
            )
        if isinstance(self.logprob_chunk_tokens, bool) or self.logprob_chunk_tokens < 1:
            problems.append(
                f"learner.logprob_chunk_tokens must be an int >= 1 (rows of logits per head chunk, e.g. 1024); got "
                f"{self.logprob_chunk_tokens}"
            )
        if self.world_size > 1 and schedule == "fully_async":
            problems.append("schedule fully_async runs on one learner rank; set learner.devices=1 and num_nodes=1")
        return problems

    def sharding_problems(self, objective: str) -> list[str]:
        """Why ``shard_statistics`` cannot shard the statistics under ``strategy`` (empty: it can)."""
        if not self.shard_statistics or self.strategy == "fsdp":
            return []
        return [
            f"learner.shard_statistics shards the statistics like FSDP2's parameters; learner.strategy "
            f"{self.strategy!r} does not shard them that way: set learner.strategy: fsdp or "
            "learner.shard_statistics: false"
        ]


def learner_strategy(settings: LearnerSettings, accelerator: str):
    """The Fabric strategy for ``settings`` on ``accelerator`` (a name Fabric accepts, or a strategy object)."""
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy

    from tslightning.distributed.fsdp_gradients import shard_policy

    timeout = timedelta(seconds=settings.timeout_s)
    on_cpu = accelerator == "cpu"
    backend = settings.process_group_backend or ("gloo" if on_cpu else None)
    if settings.strategy == "auto" and settings.world_size == 1:
        return "auto"
    if settings.strategy in ("auto", "ddp"):
        return DDPStrategy(process_group_backend=backend, timeout=timeout)
    if settings.strategy == "fsdp":
        return ModelParallelStrategy(
            shard_policy,
            data_parallel_size=settings.world_size,
            tensor_parallel_size=1,
            process_group_backend=backend,
            timeout=timeout,
        )
    stage = 2 if settings.strategy == "deepspeed_stage_2" else 3
    if on_cpu:
        from tslightning.distributed.deepspeed_cpu import CPUDeepSpeedStrategy

        return CPUDeepSpeedStrategy(stage=stage, timeout=timeout)
    return DeepSpeedStrategy(stage=stage, timeout=timeout)
