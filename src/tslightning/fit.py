"""`tslightning fit`: the Fabric-driven training loop, read top to bottom — setup → launch → fit (Algorithm 1).

Per update k: the rollout DataModule registers the logical batch at θ_k and yields ready sources as they arrive; the
streaming module serves each (``thundersync``) or holds them for the barrier (``sync``); at ``BatchClosed`` the
barrier reduces and normalizes, the callbacks check completeness and clip, exactly one optimizer step is taken, and
the weight publisher installs θ_{k+1} on every rollout replica before update k+1 starts.
"""

from __future__ import annotations

import json
import os
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from lightning.fabric.loggers import CSVLogger, TensorBoardLogger
from tqdm.auto import tqdm

from tslightning.batch_registry import BatchPlan, Objective
from tslightning.callbacks import (
    BatchBarrier,
    GPUClockCheckpoint,
    GradientClipping,
    MFUMonitor,
    ReleaseTraceRecorder,
    StalenessMonitor,
    WeightPublisher,
)
from tslightning.callbacks.gpu_clock_checkpoint import checkpointed_callbacks
from tslightning.callbacks.weight_publisher import publishable_state_dict
from tslightning.checkpoint_state import STATE_FILE, restore_checkpoint
from tslightning.learner_strategy import LearnerSettings, learner_strategy
from tslightning.precision import compute_norms_in_float64
from tslightning.rank_failure import reported_to_ranks
from tslightning.rollout.agent_loop import AgentLimits, AgentLoop
from tslightning.rollout.observation import ObservationWindow
from tslightning.rollout.rollout_datamodule import RolloutDataModule
from tslightning.rollout.teacher import TeacherScorer
from tslightning.sources import BatchClosed
from tslightning.streaming_module import OptimizerSettings, Schedule, StreamingPolicyModule
from tslightning.tasks.simulated_tool import (
    SimulatedToolEnvironment,
    SimulatedToolSettings,
    gauge_demonstrations,
    simulated_tasks,
)
from tslightning.tasks.split import split_of
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask, find_task_dirs
from tslightning.tasks.validation import library_dir
from tslightning.timeline import plot_timeline
from tslightning.tiny_model import TinyModelConfig, load_tiny_model, save_tiny_model
from tslightning.warm_start import supervised_warm_start, task_demonstrations


@dataclass
class ModelSettings:
    """The policy (and, for OPD, the frozen teacher)."""

    path: str | None = None
    """A Hugging Face checkpoint directory; ``None`` builds the embedded tiny Qwen2 model offline."""
    teacher_path: str | None = None
    """OPD teacher checkpoint; ``None``: the embedded tiny model warm-started on the reference solutions only."""
    teacher_cpus: list[int] | None = None
    """OPD: CPU cores the frozen teacher's scoring thread runs on, e.g. ``rollout.cpus`` (the teacher then sits
    beside the rollout pool, as a separate teacher pool would); ``None``: the learner process's cores, shared with
    the learner."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Learner dtype. ``float64`` (exactness checks) computes norms in float64 too; the engine then serves float32."""
    lora: LoraSettings | None = None
    """Train a LoRA adapter instead of every weight (publication merges it into the served weights)."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the embedded model when ``path`` is ``None`` (its ``seed`` is replaced by the run seed)."""


@dataclass
class LoraSettings:
    """LoRA through peft (App. D.1: r 32, α 64, dropout 0; the base weights stay frozen)."""

    r: int = 32
    alpha: int = 64
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class RolloutSettings:
    """The rollout pool, the tasks and the agent (Table 6 limits, scaled to the workload)."""

    engine: Literal["hf", "vllm"] = "hf"
    replicas: int = 1
    max_batch_size: int = 64
    """Most requests one ``hf`` replica decodes together (smaller batches return sooner, in staggered waves)."""
    prefix_cache_tokens: int = 65536
    """K/V token positions one ``hf`` replica keeps for multi-turn prefix reuse (0: re-prefill every turn)."""
    cpus: list[int] | None = None
    """CPU cores the rollout replicas (``hf`` engine) and the agent loop's threads run on (``None``: anywhere). Give
    the learner other cores (``learner.cpus``) so rollout and learner do not compete, as on separate GPUs."""
    environment: Literal["terminal", "simulated_tool"] = "terminal"
    """``terminal``: sandboxed terminal tasks; ``simulated_tool``: the benchmark's gauge tasks, whose tool calls
    sleep a seeded latency (:mod:`tslightning.tasks.simulated_tool`; ``tasks`` and ``split`` do not apply)."""
    simulated_tool: SimulatedToolSettings = field(default_factory=SimulatedToolSettings)
    """Latencies, readings and task count of the ``simulated_tool`` environment."""
    tasks: str | None = None
    """A task directory or a directory of tasks; ``None`` uses the shipped library."""
    task_names: list[str] | None = None
    """Train on these tasks only (by directory name); ``None``: every task of the split."""
    split: Literal["train", "dev", "all"] = "train"
    """Which side of the SHA-256 group split (App. C.2) to train on."""
    dev_fraction: float = 0.2
    prompts_per_update: int = 4
    samples_per_prompt: int = 4
    max_concurrent_attempts: int = 8
    max_turns: int = 4
    max_tokens_per_turn: int = 96
    max_tokens_per_trajectory: int = 384
    observation_head_tokens: int = 128
    observation_tail_tokens: int = 128
    reward_scheme: Literal["seta", "binary"] = "seta"


@dataclass
class WarmStartSettings:
    """A short supervised warm start on the tasks' reference solutions (0 steps: none)."""

    steps: int = 0
    lr: float = 3e-3
    near_misses: bool = True
    """Also demonstrate each task's plausible wrong command, so sampled groups carry a reward spread to learn from."""


_PARTITIONED = ("deepspeed_stage_2", "deepspeed_stage_3", "fsdp")
"""Learner strategies that partition the optimizer state across ranks."""
_SHARDED_PARAMETERS = ("deepspeed_stage_3", "fsdp")
"""... and the parameters too (each forward gathers them: lock-step ticks)."""


@dataclass
class CheckpointSettings:
    """GPU-clock checkpoints (SPEC §4), each written at the next optimizer boundary; resume with ``--resume DIR``."""

    interval_s: float = 3600.0
    """GPU-clock seconds between checkpoints: training wall clock × learner devices (one GPU-hour)."""
    dirpath: str | None = None
    """Directory of the ``update-<k>`` checkpoints; ``None``: ``<out_dir>/checkpoints``."""
    keep_last: int | None = 3
    """Newest checkpoints kept; ``None`` keeps all."""
    devices: int | None = None
    """Learner devices the wall clock is multiplied by; ``None``: the world size."""
    save_last: bool = True
    """Also checkpoint the final update."""
    enabled: bool = True
    """Write checkpoints at all; must be ``false`` with a DeepSpeed or FSDP learner strategy (they partition the
    optimizer state across ranks, and a checkpoint holds rank 0's replicated state)."""


@dataclass
class FitResult:
    """What one ``fit`` run did: per-update mean training reward and step time, and where things were written."""

    mean_rewards: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    teacher_gaps: list[float] = field(default_factory=list)
    """OPD: per update, mean log π_T − log π_θk over the sampled action tokens."""
    peak_learner_memory_mb: float = 0.0
    """Peak learner memory: CUDA max allocated on a GPU, else this process's max resident set (MiB)."""
    out_dir: str = ""


def fit(
    objective: Literal["grpo", "opd"] = "grpo",
    schedule: Literal["sync", "thundersync", "async", "fully_async"] = "thundersync",
    updates: int = 8,
    seed: int = 42,
    out_dir: str = "runs/quickstart",
    model: ModelSettings = ModelSettings(),  # noqa: B008 - frozen-by-convention settings, never mutated
    rollout: RolloutSettings = RolloutSettings(),  # noqa: B008
    warm_start: WarmStartSettings = WarmStartSettings(),  # noqa: B008
    optimizer: OptimizerSettings = OptimizerSettings(),  # noqa: B008
    advantage: Literal["grpo", "grpo_sample", "dr_grpo", "rloo"] = "grpo",
    max_grad_norm: float = 1.0,
    group_admission_cap: int | None = None,
    sync_micro_batch_size: int = 8,
    context_backward: Literal["recompute", "boundary"] = "recompute",
    available_flops: float | None = None,
    checkpoint: CheckpointSettings = CheckpointSettings(),  # noqa: B008
    resume: str | None = None,
    callbacks: list[L.Callback] = [],  # noqa: B006 - never mutated
    staleness_bound: int = 1,
    accelerator: str = "cpu",
    learner: LearnerSettings = LearnerSettings(),  # noqa: B008
    progress: bool = True,
) -> FitResult:
    """Train a policy with exact gradient streaming on the agentic tasks.

    Args:
        objective: ``grpo`` (Eqs. 4-7) or ``opd`` (Eqs. 8-9).
        schedule: ``thundersync`` releases each source's learner work when it is ready; ``sync`` waits for the batch;
            ``async`` is one-step-off: batch k is sampled from θ_{k−1} while the learner computes update k−1, and
            the learner evaluates the same surrogate at θ_k without importance correction (App. D.4, policy lag 1);
            ``fully_async``: rollout never stops, each update takes the first P completed groups, new weights are
            swapped into the engines in flight, and ``staleness_bound`` limits the policy lag (GRPO).
        updates: Optimizer updates (logical batches).
        seed: Run seed: model init, task order, sampling seeds.
        out_dir: Where the model, logs (CSV, TensorBoard), traces and the resolved config go.
        model: The policy and teacher.
        rollout: Rollout pool, tasks and agent limits.
        warm_start: Supervised warm start before RL.
        optimizer: AdamW settings (Table 5: lr 1e-6; the quickstart uses a larger lr to learn within minutes).
        advantage: GRPO advantage estimator.
        max_grad_norm: Global-norm clipping of the batch direction.
        group_admission_cap: Per-rank cap on GRPO groups holding statistics (App. D.3).
        sync_micro_batch_size: ``sync`` (and ``async``) learner: sequences per padded forward, sorted by length.
        context_backward: ``thundersync`` only: ``recompute`` runs each source's whole causal context; ``boundary``
            runs a GRPO group's prompt and an OPD trajectory's earlier turns once and back-propagates the summed
            boundary adjoints when the group or trajectory closes (App. I): the same update, fewer learner FLOPs.
        available_flops: Peak FLOP/s of one learner device for MFU (Eq. 10); required on CPU, where Lightning's
            table has no entry; on GPUs ``None`` reads Lightning's table.
        checkpoint: When and where checkpoints are written.
        resume: An ``update-<k>`` checkpoint directory: restore the model, optimizer, RNG, policy version and callback
            states from it, have the replicas serve the restored θ, and continue at update k + 1 up to ``updates``.
        callbacks: Extra Lightning callbacks (``class_path``/``init_args`` in configs), run after the built-in ones.
        staleness_bound: ``fully_async`` only: most versions a trained source may trail the learner.
        accelerator: Learner device kind for Fabric (``cpu``, ``cuda``, ``auto``).
        learner: Learner ranks (devices, nodes, strategy, collective timeout); each rank rolls out and streams its
            own share of every batch. Launching on several nodes: see :mod:`tslightning.learner_strategy`.
        progress: Show a progress bar.
    """
    _check_resume(resume, schedule)
    if context_backward == "boundary" and schedule != "thundersync":
        raise ValueError(
            f"context_backward 'boundary' streams context adjoints under schedule thundersync; schedule {schedule!r} "
            "runs the recompute learner (set context_backward: recompute)"
        )
    problems = learner.problems(schedule)
    if learner.strategy in _PARTITIONED and (checkpoint.enabled or resume is not None):
        problems.append(
            f"learner.strategy {learner.strategy!r} partitions the optimizer state across ranks, which GPU-clock "
            "checkpoints (rank 0's replicated state) would lose: set checkpoint.enabled=false and no resume"
        )
    if learner.strategy in _SHARDED_PARAMETERS and context_backward == "boundary":
        problems.append(
            f"learner.strategy {learner.strategy!r} serves sources in lock-step, one policy pass each; the boundary "
            "context backward runs several per source: set context_backward=recompute"
        )
    if model.teacher_cpus is not None and objective != "opd":
        problems.append(f"model.teacher_cpus places the OPD teacher; objective {objective!r} has none (set it to null)")
    if problems:
        raise ValueError("fit: " + "; ".join(problems))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(_resolved_config(locals()), indent=2, default=str))
    torch.manual_seed(seed)
    _place_learner(learner.cpus)

    tasks = _training_tasks(rollout)
    policy, tokenizer, policy_dir = _prepare_policy(model, rollout, warm_start, tasks, seed, out)
    engine = _start_engine(rollout, policy_dir, "float32" if model.dtype == "float64" else model.dtype)
    teacher = _start_teacher(model, rollout, warm_start, tasks, seed, out) if objective == "opd" else None
    datamodule = rollout_datamodule(rollout, engine, tokenizer, tasks, objective, teacher, seed)
    lag = {"async": 1, "fully_async": staleness_bound}.get(schedule, 0)
    module_clips = learner.strategy in _PARTITIONED  # gradients live in ZeRO's engine or in shards
    fabric = L.Fabric(
        accelerator=accelerator,
        devices=learner.devices,
        num_nodes=learner.num_nodes,
        strategy=learner_strategy(learner, accelerator),
        loggers=[CSVLogger(out, name="csv"), TensorBoardLogger(out, name="tensorboard")],
        callbacks=[  # order matters: publication is timed before MFU and the trace read the update's timings
            BatchBarrier(zero_staleness=lag == 0),
            *([] if module_clips else [GradientClipping(max_grad_norm)]),
            WeightPublisher(engine, every_rank=learner.world_size > 1),  # each rank rolls out with its own engine
            StalenessMonitor(max_policy_lag=lag),
            MFUMonitor(available_flops=available_flops),
            ReleaseTraceRecorder(out / "trace", datamodule=datamodule),
            *callbacks,
            *([_checkpointer(checkpoint, out, seed)] if checkpoint.enabled else []),  # last: it saves the others
        ],
    )
    fabric.launch()
    datamodule.share_with(fabric.global_rank, fabric.world_size)
    module = StreamingPolicyModule(
        policy,
        objective,
        "thundersync" if schedule == "thundersync" else "sync",  # async: batch learner work, overlapped with rollout
        advantage,
        max_grad_norm=max_grad_norm if module_clips else None,
        group_admission_cap=group_admission_cap,
        sync_micro_batch_size=sync_micro_batch_size,
        optimizer=optimizer,
        max_policy_lag=lag,
        context_backward=context_backward,
    )
    # The loop calls the module itself, not Fabric's wrapper: per-source forwards bypass DDP's (the barrier reduces).
    if learner.strategy == "fsdp":  # fully_shard replaces the parameters: the optimizer is built after it
        fabric.setup_module(module)
        fabric_optimizer = fabric.setup_optimizers(module.configure_optimizers())
    else:
        _, fabric_optimizer = fabric.setup(module, module.configure_optimizers())
    try:
        first = 0 if resume is None else _resume(resume, fabric, module, fabric_optimizer, engine)
        return _run_updates(
            fabric, module, fabric_optimizer, datamodule, updates, progress, out, schedule, first, staleness_bound
        )
    finally:
        engine.close()
        if teacher is not None:
            teacher.close()


def _run_updates(
    fabric,
    module,
    optimizer,
    datamodule,
    updates: int,
    progress: bool,
    out: Path,
    schedule: str = "thundersync",
    first: int = 0,
    staleness_bound: int = 1,
) -> FitResult:
    result = FitResult(out_dir=str(out))
    fabric.call("on_train_start", trainer=fabric, pl_module=module)
    bar = tqdm(range(first, updates), desc="updates", disable=not progress)
    prefetched = _Prefetch(datamodule, first) if schedule == "async" else None
    # fully_async: one producer keeps rolling out across updates; each batch is the first P groups to complete.
    continuous = (
        datamodule.stream_continuous(updates, staleness_bound, lambda: module.policy_version)
        if schedule == "fully_async"
        else None
    )
    try:
        for update in bar:
            start = time.perf_counter()
            if continuous is not None:
                _one_update(fabric, module, optimizer, _continuous_items(continuous), update)
            elif prefetched is None:
                _one_update(fabric, module, optimizer, datamodule.stream_update(update), update)
            else:
                prefetched = _one_step_off_update(fabric, module, optimizer, datamodule, update, updates, prefetched)
            _record_update(fabric, module, datamodule, result, update, start, schedule, bar)
    finally:
        if continuous is not None:
            continuous.close()  # stops the producer
    fabric.call("on_train_end", trainer=fabric, pl_module=module)
    result.peak_learner_memory_mb = _peak_memory_mb(fabric.device)
    for logger in fabric.loggers:
        logger.finalize("success")
    if fabric.global_rank == 0:  # the ranks share out_dir; the rewards are already over every rank's share
        (out / "rewards.json").write_text(json.dumps(asdict(result), indent=2))
    if fabric.global_rank == 0 and (out / "trace").is_dir():  # the trace appears with the first finished update
        plot_timeline(out / "trace", out / "timeline.png")
    return result


def _record_update(
    fabric, module, datamodule, result: FitResult, update: int, start: float, schedule: str, bar
) -> None:
    """Reward, step time and schedule metrics of one finished update, over every rank's share (a collective)."""
    trajectories = datamodule.trajectories[update]
    rewards = [t.reward for t in trajectories if t.reward is not None]
    gap, tokens = map(sum, zip(*(t.teacher_gap() for t in trajectories), strict=True)) if trajectories else (0, 0)
    totals = torch.tensor([sum(rewards), len(rewards), gap, tokens], dtype=torch.float64)
    if fabric.world_size > 1:
        totals = fabric.all_reduce(totals, reduce_op="sum")
    reward_sum, num_rewards, gap, tokens = totals.tolist()
    result.mean_rewards.append(reward_sum / max(num_rewards, 1))
    result.step_seconds.append(time.perf_counter() - start)
    metrics = {"train/mean_reward": result.mean_rewards[-1]}
    if schedule == "fully_async":  # groups beyond the staleness bound are dropped, never trained silently
        metrics["staleness/dropped_groups"] = float(datamodule.dropped_groups)
    if tokens:  # OPD: mean log π_T − log π_θ of the sampled tokens (−reverse-KL estimate), rises toward 0
        metrics["train/teacher_logprob_gap"] = gap / tokens
        result.teacher_gaps.append(gap / tokens)
    if module.max_grad_norm is not None and module.last_update is not None:  # the module clipped (ZeRO, FSDP)
        metrics["actor/grad_norm"] = module.last_update.direction_norm
        metrics["actor/grad_clip_coef"] = module.last_update.clip_coefficient
    fabric.log_dict(metrics, step=update)
    bar.set_postfix(reward=f"{result.mean_rewards[-1]:.3f}", step_s=f"{result.step_seconds[-1]:.1f}")


def _continuous_items(batches):
    """The next fully_async batch's items, fetched when the loop asks for the first (inside its failure report)."""
    yield from next(batches)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _one_update(fabric, module, optimizer, stream: Iterator, update: int) -> None:
    """One logical batch: ingest ``stream``'s items as they arrive, then the barrier, the step and publication."""
    waited = 0.0
    while True:
        before = time.perf_counter()
        with reported_to_ranks(update):  # this rank's rollout or ingest failing fails the update on every rank
            item = next(stream)
            waited += time.perf_counter() - before
            module.ingest(item)
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


class _Prefetch:
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


def _one_step_off_update(fabric, module, optimizer, datamodule, update: int, updates: int, batch: _Prefetch):
    """Learn update k on the batch sampled from θ_{k−1} while batch k+1 is sampled from θ_k; publish θ_{k+1} only
    after that rollout finished, so every batch is sampled by a single policy version (App. D.4)."""
    before = time.perf_counter()
    items = batch.result()
    following = _Prefetch(datamodule, update + 1) if update + 1 < updates else None
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


def _checkpointer(settings: CheckpointSettings, out: Path, seed: int) -> GPUClockCheckpoint:
    return GPUClockCheckpoint(
        settings.dirpath or out / "checkpoints",
        settings.interval_s,
        settings.devices,
        settings.keep_last,
        seed=seed,
        config=out / "config.json",
        save_last=settings.save_last,
    )


def _check_resume(resume: str | None, schedule: str) -> None:
    if resume is None:
        return
    if schedule not in ("sync", "thundersync"):
        raise ValueError(
            f"resume: schedule {schedule!r} cannot resume exactly (its next batch was sampled, at least in part, "
            "before the checkpointed θ_k, and in-flight rollouts are not checkpointed); resume with schedule sync "
            "or thundersync"
        )
    if not (Path(resume) / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume: {resume} holds no {STATE_FILE}; give an update-<k> checkpoint directory")


def _resume(path: str, fabric, module, optimizer, engine) -> int:
    """Restore a checkpoint into the set-up module, optimizer and callbacks; returns the next update index.

    The replicas still serve θ_0 from startup: publishing the restored θ_k at version k before update k samples
    anything keeps the resumed run zero-stale (and ``BatchPlan`` versions matching the module's).
    """
    point = restore_checkpoint(path, module, [optimizer], checkpointed_callbacks(fabric), fabric.global_rank)
    if fabric.global_rank == 0 or fabric.world_size > 1:  # several ranks: each has its own engine
        engine.publish(publishable_state_dict(module.policy), point.policy_version)
    fabric.barrier()
    return point.next_update


def _place_learner(cpus: list[int] | None) -> None:
    if cpus is None:
        return
    if not cpus:
        raise ValueError("learner.cpus is empty; list at least one core, or null to leave placement alone")
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def rollout_datamodule(
    rollout: RolloutSettings, engine, tokenizer, tasks, objective: str, teacher: TeacherScorer | None, seed: int
) -> RolloutDataModule:
    """The DataModule ``fit`` streams from: ``rollout``'s tasks, agent limits and concurrency on ``engine``, with the
    agent loop on ``rollout.cpus`` (beside its replicas, not on the learner's cores)."""
    return RolloutDataModule(
        engine,
        tokenizer,
        tasks,
        _attempt_factory(rollout),
        objective,
        rollout.prompts_per_update,
        rollout.samples_per_prompt,
        _agent_limits(rollout),
        teacher,
        seed,
        max_concurrent_attempts=rollout.max_concurrent_attempts,
        cpus=rollout.cpus,
    )


def _attempt_factory(rollout: RolloutSettings):
    if rollout.environment == "simulated_tool":
        return SimulatedToolEnvironment(rollout.simulated_tool)
    return lambda task: TerminalTaskAttempt(task, rollout.reward_scheme)


def _demonstrations(rollout: RolloutSettings, tasks, near_misses: bool):
    if rollout.environment == "simulated_tool":
        return gauge_demonstrations(tasks, rollout.simulated_tool, near_misses)
    return task_demonstrations(tasks, near_misses)


def _training_tasks(rollout: RolloutSettings):
    if rollout.environment == "simulated_tool":
        tasks = simulated_tasks(rollout.simulated_tool)
        if rollout.task_names is not None:
            unknown = sorted(set(rollout.task_names) - {t.task_id for t in tasks})
            if unknown:
                raise ValueError(f"rollout.task_names {unknown} are not simulated_tool tasks (gauge-0 ...)")
            tasks = [t for t in tasks if t.task_id in rollout.task_names]
        return tasks
    root = Path(rollout.tasks) if rollout.tasks else library_dir()
    tasks = [TerminalTask.load(d) for d in find_task_dirs(root)]
    if rollout.task_names is not None:
        unknown = sorted(set(rollout.task_names) - {t.name for t in tasks})
        if unknown:
            raise ValueError(f"rollout.task_names {unknown} are not tasks in {root}")
        tasks = [t for t in tasks if t.name in rollout.task_names]
    if rollout.split != "all":
        tasks = [t for t in tasks if split_of(t.group_id, rollout.dev_fraction) == rollout.split]
    if not tasks:
        raise ValueError(f"rollout.split={rollout.split!r} leaves no tasks in {root}; use split: all or more tasks")
    return tasks


def _prepare_policy(model, rollout, warm_start, tasks, seed: int, out: Path):
    """Load (or build) the policy, warm-start it, and save it where the rollout engine loads it."""
    source = Path(model.path) if model.path else save_tiny_model(out / "tiny-model", replace(model.tiny, seed=seed))
    policy, tokenizer = load_tiny_model(source)
    if warm_start.steps:
        loop = AgentLoop(engine=None, tokenizer=tokenizer, limits=_agent_limits(rollout))
        demos = _demonstrations(rollout, tasks, warm_start.near_misses)
        supervised_warm_start(policy, loop, demos, steps=warm_start.steps, lr=warm_start.lr, seed=seed)
    policy_dir = out / "policy-0"
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    policy = policy.to(getattr(torch, model.dtype))
    if model.dtype == "float64":
        compute_norms_in_float64(policy)
    if model.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = model.lora
        config = LoraConfig(
            r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
        )
        policy = get_peft_model(policy, config)
    return policy, tokenizer, policy_dir


def _agent_limits(rollout: RolloutSettings) -> AgentLimits:
    return AgentLimits(
        max_turns=rollout.max_turns,
        max_tokens_per_turn=rollout.max_tokens_per_turn,
        max_tokens_per_trajectory=rollout.max_tokens_per_trajectory,
        observation=ObservationWindow(rollout.observation_head_tokens, rollout.observation_tail_tokens),
    )


def _start_engine(rollout: RolloutSettings, policy_dir: Path, dtype: str):
    if rollout.engine == "vllm":
        from tslightning.rollout.vllm_engine import VLLMRolloutEngine

        if rollout.cpus is not None:
            raise ValueError("rollout.cpus places hf replicas; the in-process vllm engine shares the learner's cores")

        return VLLMRolloutEngine(policy_dir, dtype=dtype)
    from tslightning.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(
        policy_dir,
        dtype=dtype,
        replicas=rollout.replicas,
        cpus=rollout.cpus,
        max_batch_size=rollout.max_batch_size,
        prefix_cache_tokens=rollout.prefix_cache_tokens,
    )


def _start_teacher(model: ModelSettings, rollout, warm_start, tasks, seed: int, out: Path) -> TeacherScorer:
    """The frozen OPD teacher: ``model.teacher_path``, or — for the embedded default — the tiny model warm-started
    twice as long on the reference solutions alone, so it prefers the right command the student only sometimes
    samples."""
    if model.teacher_path:
        teacher, _ = load_tiny_model(model.teacher_path)
        return TeacherScorer(teacher, cpus=model.teacher_cpus)
    teacher, tokenizer = load_tiny_model(save_tiny_model(out / "tiny-model", replace(model.tiny, seed=seed)))
    if warm_start.steps:
        loop = AgentLoop(engine=None, tokenizer=tokenizer, limits=_agent_limits(rollout))
        demos = _demonstrations(rollout, tasks, near_misses=False)
        supervised_warm_start(teacher, loop, demos, steps=2 * warm_start.steps, lr=warm_start.lr, seed=seed + 1)
    return TeacherScorer(teacher, cpus=model.teacher_cpus)


def _resolved_config(arguments: dict) -> dict:
    return {k: asdict(v) if hasattr(v, "__dataclass_fields__") else v for k, v in arguments.items() if k != "out"}


__all__ = [
    "CheckpointSettings",
    "FitResult",
    "ModelSettings",
    "RolloutSettings",
    "WarmStartSettings",
    "fit",
    "Objective",
    "Schedule",
]
