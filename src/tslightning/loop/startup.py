"""`fit`'s start-up: the policy (built or loaded, warm-started, saved for the engine), the rollout engine, the OPD
teacher and the rollout DataModule, and the learner's cores. Which tasks a run trains on is
:mod:`tslightning.loop.task_selection`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tslightning.distributed.collectives import control_group
from tslightning.distributed.failure_watch import start_watch
from tslightning.distributed.rank_failure import agreed_by_ranks
from tslightning.distributed.rank_placement import RankPlacement
from tslightning.learner.precision import compute_norms_in_float64, serving_dtype, weight_dtype
from tslightning.loop.gpu_sharing import learner_gpu
from tslightning.loop.rollout_servers import replica_server_args, start_vllm_server
from tslightning.loop.settings import ModelSettings, RolloutSettings
from tslightning.loop.task_selection import select_tasks
from tslightning.loop.warm_start import supervised_warm_start
from tslightning.models.tiny_model import load_tiny_model, save_tiny_model
from tslightning.objectives.chunked_head import DEFAULT_CHUNK_ROWS
from tslightning.rollout.agent_loop import AgentLimits, AgentLoop
from tslightning.rollout.observation import ObservationWindow
from tslightning.rollout.rollout_datamodule import RolloutDataModule
from tslightning.rollout.teacher import TeacherScorer
from tslightning.rollout.teacher_server import TeacherServer
from tslightning.tasks.demonstrations import task_demonstrations
from tslightning.tasks.simulated_tool import SimulatedToolEnvironment, gauge_demonstrations
from tslightning.tasks.task_attempt import TerminalTaskAttempt


def prepare_policy(
    fabric,
    model: ModelSettings,
    rollout,
    warm_start,
    tasks,
    seed: int,
    out: Path,
    resume: bool,
    activation_checkpointing: bool = False,
    demonstration_format=None,
):
    """θ_0, built once: global rank 0 builds (or loads), warm-starts and saves it as ``out/policy-0``; every rank then
    loads that directory, so all ranks start from the same bytes and the engines serve them.

    Without a warm start ``policy-0`` is a link to the source checkpoint (nothing is copied). On ``resume`` there is
    no warm start — the checkpoint holds the warm-started and trained weights, published to the replicas before update
    k + 1 samples anything — and the run's ``policy-0`` is kept as it is. Returns the policy in the learner dtype (LoRA
    wrapped when asked), its tokenizer and ``policy-0``. ``demonstration_format`` (tokenizer → format) lays the warm
    start's demonstrations out as a harness's attempts reach the learner
    (:func:`tslightning.loop.harness.warm_start_format`); ``None``: the built-in agent loop's layout.
    """
    policy_dir = out / "policy-0"
    with agreed_by_ranks("set-up: building the initial policy on global rank 0"):
        if fabric.global_rank == 0 and not (resume and policy_dir.exists()):
            steps = 0 if resume else warm_start.steps  # resumed: the checkpoint holds the trained weights
            warm = replace(warm_start, steps=steps)
            _save_initial_policy(model, rollout, warm, tasks, seed, out, policy_dir, demonstration_format)
    with agreed_by_ranks("set-up: loading the initial policy"):
        policy, tokenizer = load_tiny_model(policy_dir, weight_dtype(model.precision, frozen=model.lora is not None))
        if model.precision == "64-true":
            compute_norms_in_float64(policy)
        if model.lora is not None:
            policy = _with_lora(policy, model.lora, float32_adapters=model.precision != "bf16-true")
        if activation_checkpointing:
            checkpoint_activations(policy)
    return policy, tokenizer, policy_dir


def checkpoint_activations(policy: torch.nn.Module) -> None:
    """transformers' gradient checkpointing (non-reentrant, so ``torch.autograd.grad`` passes work through it); it
    acts in training mode only, which changes nothing else of a dropout-free policy."""
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()


def _save_initial_policy(
    model, rollout, warm_start, tasks, seed: int, out: Path, policy_dir: Path, demonstration_format=None
) -> None:
    source = Path(model.path) if model.path else save_tiny_model(out / "tiny-model", replace(model.tiny, seed=seed))
    if policy_dir.is_symlink() or policy_dir.is_file():
        policy_dir.unlink()
    if not warm_start.steps:
        if policy_dir.is_dir():
            shutil.rmtree(policy_dir)
        policy_dir.symlink_to(source.resolve(), target_is_directory=True)
        return
    policy, tokenizer = load_tiny_model(source)
    loop = _demonstration_layout(tokenizer, rollout, policy.config, demonstration_format)
    if warm_start.task_names is not None:  # checked by preflight (warm_start_tasks)
        tasks = select_tasks(replace(rollout, task_names=warm_start.task_names, split="all")).tasks
    demos = demonstrations(rollout, tasks, warm_start.near_misses)
    supervised_warm_start(
        policy,
        loop,
        demos,
        steps=warm_start.steps,
        lr=warm_start.lr,
        seed=seed,
        lr_schedule=warm_start.lr_schedule,
        reference_share=warm_start.reference_share,
    )
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)


def _with_lora(policy: torch.nn.Module, lora, float32_adapters: bool) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    return get_peft_model(policy, config, autocast_adapter_dtype=float32_adapters)  # float32 over a bf16 base


def start_engine(
    rollout: RolloutSettings,
    policy_dir: Path,
    dtype: str,
    placement: RankPlacement | None = None,
    world_size: int = 1,
    max_model_len: int | None = None,
    lora=None,
):
    """This learner rank's rollout engine, serving ``policy_dir`` in ``dtype`` on its share of the node's cores
    (``rollout.cpus``) and, for ``vllm``, GPUs (``rollout.vllm.gpus``); ``vllm_server`` connects to running servers
    and publishes ``policy_dir`` to them as θ_0 — with several learner ranks, global rank 0 does (and launches the
    servers, with ``rollout.launcher ray``), then the others connect to the same servers as followers.

    Args:
        rollout: The rollout settings.
        policy_dir: θ_0's checkpoint directory.
        dtype: The dtype the engine serves (:func:`~tslightning.learner.precision.serving_dtype`).
        placement: This rank's place on its node (``None``: one rank, the whole node).
        world_size: Learner ranks in all (a vLLM engine leaves the learner's process group alone above one).
        max_model_len: The agent's context limit; ``vllm`` serves it unless ``rollout.vllm.max_model_len`` is set.
        lora: ``model.lora``: ``vllm_server`` then publishes the adapter (to ``rollout.server_adapter_dir``, by
            default ``<out_dir>/adapters``), not merged weights.
    """
    placement = placement or RankPlacement(0, 1)
    cpus = placement.share(rollout.cpus)
    if rollout.engine == "vllm":
        return _start_vllm(rollout, policy_dir, dtype, cpus, placement, world_size, max_model_len)
    if rollout.engine == "vllm_server":
        return start_vllm_server(rollout, policy_dir, dtype, max_model_len or 4096, lora)
    from tslightning.rollout.hf.engine import HFRolloutEngine

    return HFRolloutEngine(
        policy_dir,
        dtype=dtype,
        replicas=rollout.replicas,
        cpus=cpus,
        max_batch_size=rollout.max_batch_size,
        prefix_cache_tokens=rollout.prefix_cache_tokens,
    )


def _start_vllm(rollout, policy_dir: Path, dtype: str, cpus, placement: RankPlacement, world_size: int, context):
    from tslightning.rollout.vllm_engine.engine import VLLMRolloutEngine

    settings = rollout.vllm
    gpus = placement.share(settings.gpus)
    shared = settings.gpus is None and torch.cuda.is_available()  # vLLM beside the learner, on its GPU
    in_process = settings.in_process
    if in_process is None:  # a learner's process group, a placement, or a GPU shared with the learner: vLLM's own
        in_process = world_size == 1 and cpus is None and gpus is None and not shared
    if shared and not in_process:
        gpus = [learner_gpu()]  # this rank's GPU, not vLLM's default (the node's first)
    serving = dtype if settings.dtype == "auto" else settings.dtype
    return VLLMRolloutEngine(
        policy_dir,
        dtype=serving,
        max_model_len=settings.max_model_len or context or 4096,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        enforce_eager=settings.enforce_eager,
        in_process=in_process,
        cpus=None if in_process else cpus,
        gpus=gpus,
        speculative=rollout.speculative,
    )


def _demonstration_layout(tokenizer, rollout, policy_config, demonstration_format):
    """The warm start's layout: a harness's format, else the built-in agent loop's serialization."""
    if demonstration_format is not None:
        return demonstration_format(tokenizer)
    return AgentLoop(engine=None, tokenizer=tokenizer, limits=agent_limits(rollout, policy_config))


def start_teacher(
    fabric,
    model: ModelSettings,
    rollout,
    warm_start,
    tasks,
    seed: int,
    out: Path,
    resume: bool,
    placement,
    demonstration_format=None,
    chunk_tokens: int = DEFAULT_CHUNK_ROWS,
) -> TeacherScorer | TeacherServer:
    """The frozen OPD teacher: ``model.teacher_path``, or — for the embedded default — the tiny model warm-started
    twice as long on the reference solutions alone, so it prefers the right command the student only sometimes
    samples; built once on global rank 0 (``out/teacher-0``) and loaded by every rank. Its scoring thread runs on this
    rank's share of ``model.teacher_cpus``. With ``rollout.teacher_url`` the teacher is that vLLM server
    (:class:`~tslightning.rollout.teacher_server.TeacherServer`), checked against the student's tokenizer in
    ``out/policy-0``; with ``rollout.ray.teacher`` it is that checkpoint served by a vLLM server fit launches on Ray
    (:func:`~tslightning.rollout.vllm_server.ray_launcher.launch_teacher`). The in-process teacher sits on the learner's
    device in the serving dtype; its head holds at most ``chunk_tokens`` rows of logits at a time."""
    if rollout.teacher_url is not None:
        return _teacher_server(rollout, out / "policy-0", rollout.teacher_url)
    teacher_dir = Path(model.teacher_path) if model.teacher_path else out / "teacher-0"
    with agreed_by_ranks("set-up: building the OPD teacher on global rank 0"):
        if fabric.global_rank == 0 and not model.teacher_path and not (resume and teacher_dir.exists()):
            teacher, tokenizer = load_tiny_model(save_tiny_model(out / "tiny-model", replace(model.tiny, seed=seed)))
            if warm_start.steps:
                loop = _demonstration_layout(tokenizer, rollout, teacher.config, demonstration_format)
                demos = demonstrations(rollout, tasks, near_misses=False)
                supervised_warm_start(teacher, loop, demos, steps=2 * warm_start.steps, lr=warm_start.lr, seed=seed + 1)
            teacher.save_pretrained(teacher_dir)
            tokenizer.save_pretrained(teacher_dir)
    if rollout.launcher == "ray" and rollout.ray.teacher:
        with agreed_by_ranks("set-up: launching the OPD teacher's vLLM server on Ray"):
            return _launched_teacher(rollout, teacher_dir, out / "policy-0", serving_dtype(model.precision))
    with agreed_by_ranks("set-up: loading the OPD teacher"):
        # On the learner's device in the serving dtype (bf16 under bf16-mixed): a GPU run scores on its GPU, not on
        # the host in fp32. A teacher too large to sit beside the learner belongs on a server (rollout.teacher_url).
        teacher, _ = load_tiny_model(teacher_dir, getattr(torch, serving_dtype(model.precision)))
        teacher = teacher.to(fabric.device)
        return TeacherScorer(teacher, cpus=placement.share(model.teacher_cpus), chunk_tokens=chunk_tokens)


def _teacher_server(rollout: RolloutSettings, policy_dir: Path, url: str, launcher=None) -> TeacherServer:
    from transformers import AutoConfig, AutoTokenizer

    from tslightning.rollout.vllm_server.check import PROBE_TEXT

    probe = AutoTokenizer.from_pretrained(policy_dir)(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    config = AutoConfig.from_pretrained(policy_dir)
    context = agent_limits(rollout, config).max_context_tokens
    return TeacherServer(
        url, probe, config.vocab_size, context_tokens=context, timeout_s=rollout.server_timeout_s, launcher=launcher
    )


def _launched_teacher(rollout: RolloutSettings, teacher_dir: Path, policy_dir: Path, dtype: str) -> TeacherServer:
    """``teacher_dir`` served on Ray (``rollout.ray.teacher``) for the student's whole turns plus the token each
    scoring request generates, checked like a ``teacher_url`` server; stopped if that check fails."""
    from transformers import AutoConfig

    from tslightning.rollout.vllm_server.ray_launcher import launch_teacher

    context = agent_limits(rollout, AutoConfig.from_pretrained(policy_dir)).max_context_tokens + 1
    holds = getattr(AutoConfig.from_pretrained(teacher_dir), "max_position_embeddings", None) or context
    if holds < context:
        raise ValueError(
            f"rollout.ray.teacher: the teacher {teacher_dir} holds {holds} positions, scoring the student's turns "
            f"needs {context}: lower rollout.max_context_tokens to {holds - 1}"
        )
    extra = replica_server_args(rollout, rollout.ray.teacher_num_gpus)
    options = {"transport": rollout.server_transport, "dtype": dtype, "max_model_len": context, "extra": extra}
    launcher = launch_teacher(rollout.ray, teacher_dir, policy_dir.parent / "replicas", **options)
    try:
        return _teacher_server(rollout, policy_dir, launcher.urls[0], launcher)
    except BaseException:
        launcher.close()
        raise


def rollout_datamodule(
    rollout: RolloutSettings,
    engine,
    tokenizer,
    tasks,
    objective: str,
    teacher: TeacherScorer | TeacherServer | None,
    seed: int,
    placement: RankPlacement | None = None,
    policy_config=None,
    updates: int | None = None,
    agent=None,
) -> RolloutDataModule:
    """The DataModule ``fit`` streams from: ``rollout``'s tasks, agent limits and concurrency on ``engine``, with the
    agent loop on ``rollout.cpus`` (beside its replicas, not on the learner's cores), and terminal tasks'
    environments prefetched (``rollout.prefetch_environments``) up to update ``updates``; ``agent`` acts in each
    attempt (a harness, :func:`tslightning.loop.harness.start_harness`; ``None``: the built-in agent loop)."""
    return RolloutDataModule(
        engine,
        tokenizer,
        tasks,
        attempt_factory(rollout),
        objective,
        rollout.prompts_per_update,
        rollout.samples_per_prompt,
        agent_limits(rollout, policy_config),
        teacher,
        seed,
        updates=updates,
        max_concurrent_attempts=rollout.max_concurrent_attempts,
        cpus=(placement or RankPlacement(0, 1)).share(rollout.cpus),
        prefetch_environments=rollout.prefetch_environments if rollout.environment == "terminal" else 0,
        agent=agent,
        admission_order=rollout.admission_order,
    )


def attempt_factory(rollout: RolloutSettings):
    if rollout.environment == "simulated_tool":
        return SimulatedToolEnvironment(rollout.simulated_tool)
    return lambda task: TerminalTaskAttempt(
        task, rollout.reward_scheme, reward_key=rollout.reward_key, allow_internet=rollout.allow_internet
    )


def demonstrations(rollout: RolloutSettings, tasks, near_misses: bool):
    if rollout.environment == "simulated_tool":
        return gauge_demonstrations(tasks, rollout.simulated_tool, near_misses)
    return task_demonstrations(tasks, near_misses)


def agent_limits(rollout: RolloutSettings, policy_config=None) -> AgentLimits:
    """The agent's per-attempt limits; the context limit is ``rollout.max_context_tokens``, else the policy's
    ``max_position_embeddings`` (from ``policy_config``), else the agent loop's default."""
    context = rollout.max_context_tokens or getattr(policy_config, "max_position_embeddings", None)
    bounds = (
        {}
        if context is None
        else {
            "max_context_tokens": context,
            "max_prompt_tokens": max(1, min(16384, context - rollout.max_tokens_per_turn)),
        }
    )
    return AgentLimits(
        max_turns=rollout.max_turns,
        max_tokens_per_turn=rollout.max_tokens_per_turn,
        max_tokens_per_trajectory=rollout.max_tokens_per_trajectory,
        observation=ObservationWindow(rollout.observation_head_tokens, rollout.observation_tail_tokens),
        **bounds,
    )


@contextlib.contextmanager
def learner_cores(cpus: list[int] | None) -> Iterator[None]:
    """Bind this learner process to ``cpus`` (its share of ``learner.cpus``), one torch thread per core, and give the
    caller its cores and thread count back on exit (``fit`` may run inside a larger program, e.g. a test session)."""
    if cpus is None:
        yield
        return
    if not cpus:
        raise ValueError("learner.cpus is empty; list at least one core, or null to leave placement alone")
    before = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before[0])
        torch.set_num_threads(before[1])


def launched_rank(fabric, learner) -> RankPlacement:
    """Checks right after ``fabric.launch()``: one process group of Fabric's world size (an engine or library that
    started its own group first would make every collective a no-op), then the gloo group control messages use, the
    failure watch (:mod:`tslightning.distributed.failure_watch`) and this rank's cores.

    Raises:
        ValueError: if the process group's world size is not Fabric's.
    """
    group_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if group_size != fabric.world_size:
        raise ValueError(
            f"learner: the torch.distributed process group has {group_size} rank(s) but Fabric launched "
            f"{fabric.world_size}; something initialized a process group before fabric.launch() (start rollout "
            "engines after launch, or out of process)"
        )
    control_group(timedelta(seconds=learner.control_timeout_s))  # made here, where every rank is
    start_watch(learner.heartbeat_timeout_s)  # failures and deaths heard within seconds; stopped by fit
    return RankPlacement(fabric.local_rank, learner.devices)
