"""`tslightning validate`: held-out pass@k of a policy checkpoint (App. E.2, App. H.1 Eq. 31).

Loads the policy from a checkpoint (a ``save_pretrained`` directory, or a GPU-clock ``update-<k>`` training
checkpoint, exported on the fly), serves it with a rollout engine, and runs ``attempts`` independent attempts on
every evaluation task — each in a fresh sandboxed environment with a fresh agent history and its own sampling seed,
so no attempt sees another's solution or verifier feedback. An attempt succeeds only when the task's verifier
passes every test (App. E.1: official success, not the SETA partial reward). Agent mistakes, unparsable actions,
over-long prompts and exhausted budgets are failed attempts; infrastructure errors (sandbox, engine) propagate
instead of being scored. Per-task counts go into :class:`~tslightning.measure.pass_at_k.PassAtK`, and the report keeps
one success/failure record per task and attempt (App. E.3's checkpoint record).
"""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import transformers

from tslightning.callbacks.checkpoint_layout import REPLICATED, consolidated_module_state
from tslightning.callbacks.checkpoint_state import META_FILE, STATE_FILE, checkpoint_dirs, policy_hash, read_meta
from tslightning.loop.settings import RolloutSettings
from tslightning.loop.startup import agent_limits, start_engine
from tslightning.loop.task_selection import training_tasks
from tslightning.measure.pass_at_k import PassAtK
from tslightning.rollout.agent_loop import AgentLoop, PromptTooLong
from tslightning.rollout.tool_threads import run_with_tool_threads
from tslightning.sandbox import Backend
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import SandboxFactory, sandbox_factory

_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_VERSIONED_POLICY = re.compile(r"policy-(\d+)")


@dataclass(frozen=True)
class AttemptRecord:
    """One evaluation attempt's outcome.

    Attributes:
        task: The task id.
        attempt: The attempt's index within its task (also its sampling-seed index).
        success: The verifier passed every test.
        passed_fraction: Fraction of verifier tests passed; ``None`` when the verifier did not run or was unreadable.
        end_reason: Why the agent stopped (``finished``, ``max_turns``, ``prompt_too_long``, ...).
        turns: Agent turns taken.
    """

    task: str
    attempt: int
    success: bool
    passed_fraction: float | None
    end_reason: str
    turns: int


def validate(  # the limits default to `fit`'s: training and evaluation share per-attempt limits (Table 6)
    checkpoint: str,
    tasks: str | None = None,
    split: Literal["train", "dev", "all"] | None = None,
    dev_fraction: float = RolloutSettings.dev_fraction,
    attempts: int = 3,
    k: Sequence[int] = (1, 3),
    engine: Literal["hf", "vllm"] = "hf",
    seed: int = 0,
    max_turns: int = RolloutSettings.max_turns,
    max_tokens_per_turn: int = RolloutSettings.max_tokens_per_turn,
    max_tokens_per_trajectory: int = RolloutSettings.max_tokens_per_trajectory,
    observation_head_tokens: int = RolloutSettings.observation_head_tokens,
    observation_tail_tokens: int = RolloutSettings.observation_tail_tokens,
    max_concurrent_attempts: int = RolloutSettings.max_concurrent_attempts,
    replicas: int = 1,
    dtype: Literal["float32", "bfloat16"] = "float32",
    backend: Backend = "bubblewrap",
    out: str | None = None,
    task_names: list[str] | None = None,
) -> dict:
    """Estimate pass@k of a checkpoint's policy on held-out tasks.

    Args:
        checkpoint: A ``save_pretrained`` policy directory, an ``update-<k>`` training checkpoint, or a directory
            holding one (a ``fit`` output directory: its latest checkpoint, else its ``policy-0``); see
            :func:`resolve_checkpoint`.
        tasks: A task directory or a directory of tasks; ``None`` uses the shipped library.
        split: Side of the SHA-256 group split (App. C.2) to evaluate; ``all`` takes every task; ``None``: ``dev``
            (the ``tslightning validate`` command then compares a ``fit`` run's final policy with its policy-0 on
            both sides: :func:`~tslightning.commands.policy_comparison.validate_or_compare`).
        dev_fraction: Development share of the split (use the training run's value).
        attempts: Independent attempts per task, n (App. E.2: 3).
        k: The pass@k to report; each k must be at most ``attempts``.
        engine: Rollout engine serving the policy.
        seed: Evaluation seed; attempt j of a task samples with seeds derived from (seed, task, j).
        max_turns: Agent turns per attempt (Table 6; keep the training run's limits).
        max_tokens_per_turn: Generated tokens per turn.
        max_tokens_per_trajectory: Generated tokens per attempt.
        observation_head_tokens: Tool-output tokens kept from the head of each observation.
        observation_tail_tokens: Tool-output tokens kept from its tail.
        max_concurrent_attempts: Attempts in flight at once.
        replicas: Rollout replicas (``hf`` engine).
        dtype: Dtype the engine serves the policy in.
        backend: Sandbox backend of the attempts.
        out: Write the report here as JSON.
        task_names: Evaluate these tasks only (by directory name), of the split's side; ``None``: every task.

    Returns:
        The report: ``pass_at_k`` (``{"pass@k": fraction}``), ``tasks`` (per task ``n``, ``c`` and its pass@k
        estimates), ``records`` (one per attempt), ``checkpoint`` (the path evaluated and, for a training
        checkpoint, its seed, update, policy version and hash, publication time and GPU-clock) and ``settings``.

    Raises:
        ValueError: Listing every invalid argument, or when the split leaves no tasks.
        FileNotFoundError: If ``checkpoint`` holds no policy.
    """
    ks = _check_arguments(attempts, k, max_concurrent_attempts)
    source = resolve_checkpoint(checkpoint)
    settings = RolloutSettings(
        engine=engine,
        replicas=replicas,
        tasks=tasks,
        split=split or "dev",
        task_names=task_names,
        dev_fraction=dev_fraction,
        max_turns=max_turns,
        max_tokens_per_turn=max_tokens_per_turn,
        max_tokens_per_trajectory=max_tokens_per_trajectory,
        observation_head_tokens=observation_head_tokens,
        observation_tail_tokens=observation_tail_tokens,
    )
    task_list = training_tasks(settings)  # the same task loading and split rule as `fit`
    with ExitStack() as stack:
        policy_dir = source
        if _is_training_checkpoint(source):
            policy_dir = export_policy(source, Path(stack.enter_context(tempfile.TemporaryDirectory())) / "policy")
        tokenizer = transformers.AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
        rollout_engine = start_engine(settings, policy_dir, dtype)
        stack.callback(rollout_engine.close)
        agent = AgentLoop(rollout_engine, tokenizer, agent_limits(settings), run_seed=seed)
        records = run_with_tool_threads(
            _run_attempts(agent, task_list, attempts, max_concurrent_attempts, sandbox_factory(backend)),
            max_concurrent_attempts,
        )
    report = _report(records, task_list, ks)
    report["checkpoint"] = {"path": str(source), **_checkpoint_record(source)}
    report["settings"] = _settings(locals())
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """The policy ``checkpoint`` names: a ``save_pretrained`` directory or an ``update-<k>`` training checkpoint.

    In order: ``checkpoint`` itself when it is either; its ``policy/``; the newest ``update-<k>`` in it or in its
    ``checkpoints/`` (a ``fit`` output directory: the latest GPU-clock checkpoint); its ``policy-<version>/`` with
    the highest version (``fit`` saves the initial policy as ``policy-0``).
    """
    root = Path(checkpoint)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint {root} is not a directory")
    if _is_policy_dir(root) or _is_training_checkpoint(root):
        return root
    if _is_policy_dir(root / "policy"):
        return root / "policy"
    updates = [p for p in checkpoint_dirs(root) or checkpoint_dirs(root / "checkpoints") if _is_training_checkpoint(p)]
    if updates:
        return updates[-1]
    versioned = [
        (int(match.group(1)), child)
        for child in root.iterdir()
        if (match := _VERSIONED_POLICY.fullmatch(child.name)) and _is_policy_dir(child)
    ]
    if versioned:
        return max(versioned)[1]
    raise FileNotFoundError(
        f"checkpoint {root} holds no policy: expected a save_pretrained directory (config.json and "
        f"{' or '.join(_WEIGHT_FILES)}) or an update-<k> checkpoint ({STATE_FILE}, {META_FILE}) there, under "
        "policy/ or checkpoints/, or a policy-<version>/"
    )


def export_policy(checkpoint: str | Path, target: str | Path) -> Path:
    """Write the policy θ of an ``update-<k>`` training checkpoint to ``target`` as a ``save_pretrained`` directory.

    The run's ``policy-0/`` (beside the checkpoints directory, or under the recorded ``out_dir``) supplies the
    architecture and tokenizer; the checkpoint's module state (a sharded one's shards joined) replaces every weight,
    LoRA adapters (``model.lora`` in the recorded config) are merged into the base weights as publication serves
    them, and the trained weights must hash to the recorded ``policy_hash``.
    """
    checkpoint, target = Path(checkpoint), Path(target)
    meta = read_meta(checkpoint)
    base = _run_policy_dir(checkpoint, meta)
    policy = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, local_files_only=True)
    lora = (meta.get("config", {}).get("model") or {}).get("lora")
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=lora["target_modules"]
        )
        policy = get_peft_model(policy, config)
    layout = meta.get("layout", REPLICATED)
    if layout == REPLICATED:
        state = torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=True)["state_dict"]
    else:  # FSDP2 or DeepSpeed shards, joined in this process
        state = consolidated_module_state(checkpoint / STATE_FILE, layout)
    policy.load_state_dict({name.removeprefix("policy."): value for name, value in state.items()}, strict=True)
    if policy_hash(policy) != meta["policy_hash"]:
        raise RuntimeError(
            f"{checkpoint}: the exported weights do not hash to the recorded policy_hash; was {base} the run's policy?"
        )
    served = policy.merge_and_unload() if lora else policy  # the weights publication serves (WeightPublisher)
    served.save_pretrained(target)
    transformers.AutoTokenizer.from_pretrained(base, local_files_only=True).save_pretrained(target)
    return target


def format_report(report: dict) -> str:
    """A fixed-width table: per task n, c and pass@k (in %), then the overall pass@k."""
    names = list(report["pass_at_k"])
    width = max([len("task"), *(len(task) for task in report["tasks"])])
    header = f"{'task':<{width}}  {'n':>3}  {'c':>3}" + "".join(f"  {name:>8}" for name in names)
    lines = [header, "-" * len(header)]
    for task, row in report["tasks"].items():
        scores = "".join(f"  {100 * row[name]:>7.1f}%" for name in names)
        lines.append(f"{task:<{width}}  {row['n']:>3}  {row['c']:>3}{scores}")
    lines.append("-" * len(header))
    overall = "".join(f"  {100 * report['pass_at_k'][name]:>7.1f}%" for name in names)
    label = f"mean of {len(report['tasks'])} tasks"
    lines.append(f"{label:<{width + 10}}{overall}")
    return "\n".join(lines)


async def _run_attempts(
    agent: AgentLoop, tasks: list[TerminalTask], attempts: int, concurrency: int, factory: SandboxFactory
) -> list[AttemptRecord]:
    gate = asyncio.Semaphore(concurrency)

    async def attempt(task: TerminalTask, index: int) -> AttemptRecord:
        async with gate:
            return await _attempt(agent, task, index, factory)

    return list(await asyncio.gather(*(attempt(task, j) for task in tasks for j in range(attempts))))


async def _attempt(agent: AgentLoop, task: TerminalTask, index: int, factory: SandboxFactory) -> AttemptRecord:
    """One attempt in a fresh environment; success is the verifier's full pass (p = 1)."""
    environment = await asyncio.to_thread(TerminalTaskAttempt, task, "binary", factory)
    with environment:
        try:
            trajectory = await agent.run(task.task_id, task.instruction, environment, task.task_id, index, update=0)
        except PromptTooLong:  # an over-long prompt stays in the denominator as a failure (App. E.2)
            return AttemptRecord(task.task_id, index, False, None, "prompt_too_long", 0)
    verdict = environment.verification  # None when the agent took no turn (the loop then skips the verifier)
    passed_fraction = None if verdict is None else verdict.passed_fraction
    success = verdict is not None and verdict.passed
    return AttemptRecord(task.task_id, index, success, passed_fraction, trajectory.end_reason, len(trajectory.turns))


def _report(records: list[AttemptRecord], tasks: list[TerminalTask], ks: tuple[int, ...]) -> dict:
    metric = PassAtK(ks, [task.task_id for task in tasks], sync_on_compute=False)  # one process ran every attempt
    metric.update([r.task for r in records], [r.success for r in records])
    per_task = metric.per_task()
    rows = {
        task: {
            "n": int(metric.attempts[i]),
            "c": int(metric.successes[i]),
            **{name: float(scores[i]) for name, scores in per_task.items()},
        }
        for i, task in enumerate(metric.tasks)
    }
    fractions = [r.passed_fraction or 0.0 for r in records]
    return {
        "pass_at_k": {name: float(score) for name, score in metric.compute().items()},
        "mean_passed_fraction": sum(fractions) / len(fractions) if fractions else 0.0,
        "tasks": rows,
        "records": [asdict(record) for record in records],
    }


def _check_arguments(attempts: int, k: Sequence[int], concurrency: int) -> tuple[int, ...]:
    ks = tuple(k)
    problems = []
    if attempts < 1:
        problems.append(f"attempts must be >= 1; got {attempts}")
    if not ks or any(value < 1 for value in ks):
        problems.append(f"k must be a non-empty list of positive integers; got {list(ks)}")
    elif max(ks) > attempts:
        problems.append(f"pass@{max(ks)} needs attempts >= {max(ks)}; got attempts={attempts} (raise --attempts)")
    if concurrency < 1:
        problems.append(f"max_concurrent_attempts must be >= 1; got {concurrency}")
    if problems:
        raise ValueError("; ".join(problems))
    return tuple(sorted(set(ks)))


def _is_policy_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any((path / name).is_file() for name in _WEIGHT_FILES)


def _is_training_checkpoint(path: Path) -> bool:
    return (path / STATE_FILE).exists() and (path / META_FILE).is_file()  # state.pt: a file, or a sharded directory


def _run_policy_dir(checkpoint: Path, meta: dict[str, Any]) -> Path:
    """The run's initial policy: ``<out_dir>/policy-0`` beside the default ``<out_dir>/checkpoints``, or under the
    ``out_dir`` the checkpoint's config records."""
    candidates = [checkpoint.parent.parent / "policy-0"]
    if out_dir := meta.get("config", {}).get("out_dir"):
        candidates.append(Path(out_dir) / "policy-0")
    for candidate in candidates:
        if _is_policy_dir(candidate):
            return candidate
    raise FileNotFoundError(
        f"{checkpoint} holds training state, not a served policy, and the run's policy-0/ (its architecture and "
        f"tokenizer) is not at {' or '.join(map(str, candidates))}"
    )


def _checkpoint_record(source: Path) -> dict[str, Any]:
    """What App. E.3's checkpoint record binds, when the checkpoint recorded it."""
    if not _is_training_checkpoint(source):
        return {}
    meta = read_meta(source)
    keys = ("seed", "update", "policy_version", "policy_hash", "published_at", "gpu_clock_s", "trajectories_seen")
    return {key: meta.get(key) for key in keys}


def _settings(arguments: dict) -> dict:
    kept = (
        "tasks",
        "task_names",
        "split",
        "dev_fraction",
        "attempts",
        "engine",
        "seed",
        "max_turns",
        "max_tokens_per_turn",
    )
    kept += ("max_tokens_per_trajectory", "observation_head_tokens", "observation_tail_tokens", "dtype", "backend")
    return {name: arguments[name] for name in kept} | {"k": list(arguments["ks"]), "split": arguments["split"] or "dev"}


__all__ = ["AttemptRecord", "export_policy", "format_report", "resolve_checkpoint", "validate"]
