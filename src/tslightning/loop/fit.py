"""`tslightning fit`: the Fabric-driven training loop, read top to bottom — setup → launch → fit (Algorithm 1).

Per update k: the rollout DataModule registers the logical batch at θ_k and yields ready sources as they arrive; the
streaming module serves each (``thundersync``) or holds them for the barrier (``sync``); at ``BatchClosed`` the
barrier reduces and normalizes, the callbacks check completeness and clip, exactly one optimizer step is taken, and
the weight publisher installs θ_{k+1} on every rollout replica before update k+1 starts.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_info
from tqdm.auto import tqdm

from tslightning.callbacks import (
    BatchBarrier,
    GradientClipping,
    MFUMonitor,
    ReleaseTraceRecorder,
    StalenessMonitor,
    WeightPublisher,
)
from tslightning.core.batch_registry import Objective
from tslightning.distributed.failure_watch import stop_watch
from tslightning.distributed.learner_strategy import LearnerSettings, learner_strategy
from tslightning.distributed.parameter_placement import placement_for
from tslightning.distributed.rank_failure import agreed_by_ranks
from tslightning.learner.precision import serving_dtype
from tslightning.learner.streaming_module import Schedule, StreamingPolicyModule
from tslightning.loop.batch_recording import batch_file, recorded
from tslightning.loop.batch_replay import RecordedBatches
from tslightning.loop.harness import start_harness, warm_start_format
from tslightning.loop.learner_shape import planned_memory, policy_config
from tslightning.loop.preflight import preflight
from tslightning.loop.resume import checkpointer, resume_from
from tslightning.loop.run_config import resolved_config
from tslightning.loop.run_directory import RunDirectory, open_run_directory
from tslightning.loop.run_loggers import DEFAULT_LOGGERS, make_loggers
from tslightning.loop.run_summary import RunSummary, StepTimes, logger_locations, predicted_speedup
from tslightning.loop.settings import (
    AlgorithmSettings,
    CheckpointSettings,
    LoraSettings,
    ModelSettings,
    RolloutSettings,
)
from tslightning.loop.startup import (
    agent_limits,
    launched_rank,
    learner_cores,
    prepare_policy,
    rollout_datamodule,
    start_engine,
    start_teacher,
)
from tslightning.loop.updates import (
    FitResult,
    Prefetch,
    continuous_items,
    one_step_off_update,
    one_update,
    peak_memory_mb,
    record_update,
    rollout_outcome,
)
from tslightning.loop.warm_start import WarmStartSettings
from tslightning.measure.device_clock import synchronized_clock
from tslightning.measure.memory_plan import plan_report
from tslightning.measure.timeline import plot_timeline
from tslightning.rollout.engine import RolloutEngine
from tslightning.rollout.harness.settings import HarnessSettings
from tslightning.rollout.rollout_datamodule import RolloutDataModule


def fit(
    objective: Literal["grpo", "opd"] = "grpo",
    schedule: Literal["sync", "thundersync", "async", "fully_async"] = "thundersync",
    updates: int = 8,
    seed: int = 42,
    out_dir: str = "runs/quickstart",
    model: ModelSettings = ModelSettings(),  # noqa: B008 - frozen-by-convention settings, never mutated
    rollout: RolloutSettings = RolloutSettings(),  # noqa: B008
    warm_start: WarmStartSettings = WarmStartSettings(),  # noqa: B008
    algorithm: AlgorithmSettings = AlgorithmSettings(),  # noqa: B008
    available_flops: float | None = None,
    checkpoint: CheckpointSettings = CheckpointSettings(),  # noqa: B008
    resume: str | None = None,
    overwrite: bool = False,
    callbacks: list[L.Callback] = [],  # noqa: B006 - never mutated
    loggers: list[dict[str, Any]] = list(DEFAULT_LOGGERS),  # noqa: B006, B008 - never mutated
    staleness_bound: int = 1,
    accelerator: str = "cpu",
    learner: LearnerSettings = LearnerSettings(),  # noqa: B008
    progress: bool = True,
    record_batches: bool = False,
    replay_batches: str | None = None,
    harness: HarnessSettings = HarnessSettings(),  # noqa: B008
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
        out_dir: Where the model, logs (CSV, TensorBoard), traces, checkpoints and the resolved config (``config.yaml``,
            re-runnable with ``--config``) go. It must not hold an earlier run's outputs unless ``resume`` continues
            that run or ``overwrite`` replaces it.
        model: The policy and teacher.
        rollout: Rollout pool, tasks and agent limits.
        warm_start: Supervised warm start before RL.
        algorithm: The learning algorithm: advantage estimator, clipping, AdamW, and how the learner computes the
            exact update (group admission cap, context backward, padded micro-batches).
        available_flops: Peak FLOP/s of one learner device for MFU (Eq. 10); ``None`` reads the device's dense peak
            (:mod:`tslightning.callbacks.peak_flops`); a device no table knows (a CPU) then logs no MFU.
        checkpoint: When and where checkpoints are written.
        resume: An ``update-<k>`` checkpoint directory: restore the model, optimizer, RNG, policy version and callback
            states from it, have the replicas serve the restored θ, and continue at update k + 1 up to ``updates``.
            There is no warm start (the checkpoint holds the trained weights), and the resumed segment writes its own
            ``config.resume-<n>.yaml`` and ``rewards.resume-<n>.json`` beside the run's.
        overwrite: Replace the earlier run in ``out_dir``: remove what ``fit`` wrote there (config, logs, trace,
            checkpoints, policy) before starting. Without it, a run into a used ``out_dir`` is refused.
        callbacks: Extra callbacks (``class_path``/``init_args`` in configs), run after the built-in ones. The loop is
            Fabric's, so Lightning's Trainer callbacks (ModelCheckpoint, Timer, ThroughputMonitor, ...) are refused.
        loggers: Where metrics go, as ``class_path``/``init_args`` (LightningCLI's ``trainer.logger`` form): any
            Lightning logger, e.g. ``WandbLogger`` (``init_args: {offline: true}``) or ``MLFlowLogger`` (a file store
            under ``out_dir/mlruns`` unless ``tracking_uri`` is given); a logger's ``root_dir``/``save_dir`` defaults
            to ``out_dir``. Default: CSV and TensorBoard (:mod:`tslightning.loop.run_loggers`).
        staleness_bound: ``fully_async`` only: most versions a trained source may trail the learner.
        accelerator: Learner device kind for Fabric (``cpu``, ``cuda``, ``auto``).
        learner: Learner ranks (devices, nodes, strategy, collective timeout); each rank rolls out and streams its
            own share of every batch. Launching on several nodes: see :mod:`tslightning.distributed.learner_strategy`.
        progress: Show a progress bar.
        record_batches: Save each rank's stream items of every update under ``<out_dir>/batches/`` for an offline
            replay (:mod:`tslightning.loop.batch_recording`); schedules ``sync``, ``thundersync`` and ``fully_async``.
        replay_batches: A recorded run's ``<out_dir>/batches``: each rank ingests, per update, exactly the items it
            recorded, in the recorded order, instead of rolling out; no rollout engine or teacher is started and
            nothing is published (:mod:`tslightning.loop.batch_replay`). Needs a file per rank and update, recorded
            on this world size with this objective at the versions the replay reaches (a ``sync`` or
            ``thundersync`` recording); schedules ``sync`` and ``thundersync``.
        harness: The agent acting in each attempt: the built-in loop, or a harness (mini-swe-agent, your own program)
            talking to this rank's OpenAI-compatible gateway, every call one turn sampled at θ_k with its exact ids.
    """
    arguments = dict(locals())  # the resolved config, before any local of fit's own joins it
    tasks = preflight(**arguments)  # every problem at once, before anything is written
    config = resolved_config(arguments)
    run = open_run_directory(out_dir, config, resume, overwrite, checkpoint.dirpath if checkpoint.enabled else None)
    out = run.path
    torch.manual_seed(seed)
    lag = {"async": 1, "fully_async": staleness_bound}.get(schedule, 0)
    strategy = "ddp" if learner.strategy == "auto" and learner.world_size > 1 else learner.strategy
    placement = placement_for(strategy, learner.shard_statistics)  # chosen once: everything else asks it
    module_clips = placement.clips_in_module  # gradients live in ZeRO's engine or in shards
    replay = None if replay_batches is None else Path(replay_batches)
    # A replay starts no engine: nothing serves θ, so nothing publishes it (not a publisher with nobody to talk to).
    publisher = None if replay else WeightPublisher(every_rank=learner.world_size > 1)  # engine: set after launch
    recorder = ReleaseTraceRecorder(out / "trace")  # its datamodule: likewise
    monitor = MFUMonitor(available_flops=available_flops)  # its step-time breakdown feeds the end-of-run summary
    fabric = L.Fabric(
        accelerator=accelerator,
        devices=learner.devices,
        num_nodes=learner.num_nodes,
        strategy=learner_strategy(learner, accelerator),
        precision=model.precision,
        loggers=make_loggers(loggers, out),
        callbacks=[  # order matters: publication is timed before MFU and the trace read the update's timings
            BatchBarrier(zero_staleness=lag == 0),
            *([] if module_clips else [GradientClipping(algorithm.max_grad_norm)]),
            *([publisher] if publisher else []),
            StalenessMonitor(max_policy_lag=lag),
            monitor,
            recorder,
            *callbacks,
            *([checkpointer(checkpoint, out, seed, config)] if checkpoint.enabled else []),  # last: saves the others
        ],
    )
    fabric.launch()  # everything below runs once per learner rank, in one process group
    statistics_device = _statistics_device(fabric, arguments)
    ranks = launched_rank(fabric, learner)
    with contextlib.ExitStack() as started:
        started.callback(stop_watch)  # last to close: the ranks may leave in any order after it
        started.enter_context(learner_cores(ranks.share(learner.cpus)))
        layout = warm_start_format(harness) if warm_start.steps and not resume and fabric.global_rank == 0 else None
        policy, tokenizer, policy_dir = prepare_policy(
            fabric, model, rollout, warm_start, tasks, seed, out, bool(resume), learner.activation_checkpointing, layout
        )
        if replay is None:
            engine, datamodule = _start_rollout(
                started, fabric, ranks, policy, tokenizer, policy_dir, tasks, out, **arguments
            )
            publisher.engine, recorder.datamodule = engine, datamodule
        else:
            engine, datamodule = None, RecordedBatches(replay, fabric.global_rank)
            rank_zero_info(f"replay_batches: replaying {replay}; no rollout engine is started, nothing is published")
        module = StreamingPolicyModule(
            policy,
            objective,
            "thundersync" if schedule == "thundersync" else "sync",  # async: batch learner work, overlapped
            algorithm.advantage,
            max_grad_norm=algorithm.max_grad_norm if module_clips else None,
            group_admission_cap=algorithm.group_admission_cap,
            micro_batch_size=algorithm.micro_batch_size,
            backlog_tokens=agent_limits(rollout, policy.config).max_context_tokens,  # what the memory plan holds
            optimizer=algorithm.optimizer,
            max_policy_lag=lag,
            context_backward=algorithm.context_backward,
            statistics_device=statistics_device,
            fold_queue_depth=learner.fold_queue_depth,
            logprob_chunk_tokens=learner.logprob_chunk_tokens,
            placement=placement,
        )
        fabric_optimizer = _set_up(fabric, module)
        first = 0 if resume is None else resume_from(resume, fabric, module, fabric_optimizer, engine)
        batches = out / "batches" if record_batches else None
        result = _run_updates(
            fabric,
            module,
            fabric_optimizer,
            datamodule,
            updates,
            progress,
            run,
            schedule,
            first,
            staleness_bound,
            batches,
        )
        if fabric.global_rank == 0:
            print(_summary(fabric, result, monitor, run, objective, schedule, first, checkpoint).text(), flush=True)
        return result


def _summary(fabric, result, monitor, run: RunDirectory, objective, schedule, first, checkpoint) -> RunSummary:
    """The end-of-run summary (:mod:`tslightning.loop.run_summary`) of this segment."""
    checkpoints = Path(checkpoint.dirpath) if checkpoint.dirpath else run.path / "checkpoints"
    return RunSummary(
        result,
        objective,
        schedule,
        StepTimes.measured(list(monitor.history)[-len(result.step_seconds) :], result.step_seconds),
        first_update=first,
        predicted_speedup=predicted_speedup(run.path / "trace") if (run.path / "trace").is_dir() else None,
        logs=logger_locations(fabric.loggers),
        config_file=run.config_file,
        checkpoints=checkpoints if checkpoint.enabled else None,
    )


def _start_rollout(
    started: contextlib.ExitStack,
    fabric,
    placement,
    policy,
    tokenizer,
    policy_dir: Path,
    tasks,
    out: Path,
    *,
    updates: int,
    objective: str,
    seed: int,
    model: ModelSettings,
    rollout: RolloutSettings,
    warm_start: WarmStartSettings,
    learner: LearnerSettings,
    resume: str | None,
    harness: HarnessSettings,
    **unused,
) -> tuple[RolloutEngine, RolloutDataModule]:
    """This rank's rollout engine (and OPD teacher) serving ``policy_dir``, and the rollout DataModule streaming its
    share of each batch from them (with ``harness``, from this rank's gateway in front of the engine); all are closed
    when ``started`` unwinds."""
    with agreed_by_ranks("set-up: starting the rollout engine and the teacher"):
        context = agent_limits(rollout, policy.config).max_context_tokens
        engine = started.enter_context(
            start_engine(
                rollout, policy_dir, serving_dtype(model.precision), placement, learner.world_size, context, model.lora
            )
        )
        teacher = None
        if objective == "opd":
            layout = warm_start_format(harness) if warm_start.steps else None
            teacher = start_teacher(
                fabric,
                model,
                rollout,
                warm_start,
                tasks,
                seed,
                out,
                bool(resume),
                placement,
                layout,
                chunk_tokens=learner.logprob_chunk_tokens,
            )
            started.callback(teacher.close)
        agent = None
        if harness.enabled:
            agent = start_harness(harness, engine, tokenizer, rollout, policy.config, seed, out)
            started.callback(agent.close)
    datamodule = rollout_datamodule(
        rollout, engine, tokenizer, tasks, objective, teacher, seed, placement, policy.config, updates, agent
    )
    started.callback(datamodule.teardown, "fit")  # prefetched environments no update took are closed
    datamodule.share_with(fabric.global_rank, fabric.world_size, spread_groups=learner.shard_statistics)
    return engine, datamodule


def _statistics_device(fabric, arguments: dict) -> str:
    """Where this run's statistics live, ``learner.statistics_device: auto`` resolved by the per-rank memory plan on
    this rank's device, which global rank 0 prints on an accelerator (a CPU learner has one memory: the host)."""
    learner, model, rollout = arguments["learner"], arguments["model"], arguments["rollout"]
    if fabric.device.type != "cuda":
        return "host" if learner.statistics_device == "auto" else learner.statistics_device
    available = torch.cuda.get_device_properties(fabric.device).total_memory
    planned = planned_memory(
        policy_config(model), arguments["objective"], arguments["schedule"], model, rollout, learner,
        arguments["algorithm"].group_admission_cap, arguments["algorithm"].micro_batch_size, available,
        arguments["algorithm"].optimizer.state_dtype,
    )  # fmt: skip
    rank_zero_info(plan_report(planned.plan, planned.shape, available / 2**30, learner.activation_checkpointing))
    return planned.statistics_device


def _set_up(fabric, module: StreamingPolicyModule):
    """Fabric's set-up of the module and its optimizer. The loop calls the module itself, not Fabric's wrapper:
    per-source forwards bypass DDP's (the barrier reduces)."""
    if module.placement.name == "fsdp":  # fully_shard replaces the parameters: the optimizer is built after it
        fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(module.configure_optimizers())
        module._fabric_optimizers = [optimizer]  # as fabric.setup links them: module.optimizers() (checkpoints)
        return optimizer
    _, optimizer = fabric.setup(module, module.configure_optimizers())
    return optimizer


def _run_updates(
    fabric,
    module,
    optimizer,
    datamodule,
    updates: int,
    progress: bool,
    run: RunDirectory,
    schedule: str = "thundersync",
    first: int = 0,
    staleness_bound: int = 1,
    batches: Path | None = None,
) -> FitResult:
    out = run.path
    result = FitResult(out_dir=str(out))
    fabric.call("on_train_start", trainer=fabric, pl_module=module)
    bar = tqdm(range(first, updates), desc="updates", disable=not progress)
    prefetched = Prefetch(datamodule, first) if schedule == "async" else None
    # fully_async: one producer keeps rolling out across updates; each batch is the first P groups to complete.
    continuous = (
        datamodule.stream_continuous(updates, staleness_bound, lambda: module.policy_version)
        if schedule == "fully_async"
        else None
    )
    replay = isinstance(datamodule, RecordedBatches)
    try:
        for update in bar:
            start = synchronized_clock(fabric.device)
            if continuous is not None:
                items = recorded(
                    continuous_items(continuous), batches and batch_file(batches, fabric.global_rank, update)
                )
                one_update(fabric, module, optimizer, items, update)
            elif prefetched is None:
                items = recorded(
                    datamodule.stream_update(update), batches and batch_file(batches, fabric.global_rank, update)
                )
                one_update(fabric, module, optimizer, items, update)
            else:
                prefetched = one_step_off_update(fabric, module, optimizer, datamodule, update, updates, prefetched)
            outcome = datamodule.outcome(update) if replay else rollout_outcome(datamodule, update, schedule)
            record_update(fabric, module, outcome, result, update, start, bar)
    finally:
        if continuous is not None:
            continuous.close()  # stops the producer
    fabric.call("on_train_end", trainer=fabric, pl_module=module)
    result.peak_learner_memory_mb = peak_memory_mb(fabric.device)
    for logger in fabric.loggers:
        logger.finalize("success")
    if fabric.global_rank == 0:  # the ranks share out_dir; the rewards are already over every rank's share
        run.rewards_file.write_text(json.dumps(asdict(result), indent=2))
    if fabric.global_rank == 0 and (out / "trace").is_dir():  # the trace appears with the first finished update
        plot_timeline(out / "trace", out / "timeline.png")
    return result


__all__ = [
    "AlgorithmSettings",
    "CheckpointSettings",
    "FitResult",
    "HarnessSettings",
    "LoraSettings",
    "ModelSettings",
    "RolloutSettings",
    "WarmStartSettings",
    "fit",
    "Objective",
    "Schedule",
]
