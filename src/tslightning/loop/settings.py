"""`fit`'s typed settings: the policy, the rollout pool and tasks, the warm start and checkpoints (jsonargparse derives
the CLI from these dataclasses and their attribute docstrings), and the checks run on them before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from tslightning.distributed.rank_placement import share_problems
from tslightning.learner.precision import Precision
from tslightning.models.tiny_model import TinyModelConfig
from tslightning.tasks.simulated_tool import SimulatedToolSettings


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
    precision: Precision = "32-true"
    """Learner precision (Fabric's names). ``bf16-mixed``: bfloat16 compute over float32 master weights and float32
    optimizer state (with LoRA: float32 adapters over a frozen bfloat16 base) — what large-model runs want;
    ``bf16-true``: bfloat16 weights and optimizer state (updates below bfloat16's resolution, e.g. at lr 1e-6, are
    lost); ``64-true``: float64 for exactness checks (norms in float64 too). Engines serve bfloat16 under bf16-*,
    else float32."""
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
class VLLMSettings:
    """The ``vllm`` engine of each learner rank (``rollout.engine: vllm``)."""

    max_model_len: int | None = None
    """Longest context vLLM serves; ``None``: ``rollout.max_context_tokens``. Must cover the longest trajectory
    (prompt, every action and every kept observation)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each of the engine's GPUs vLLM may use (weights, activations, KV cache)."""
    tensor_parallel_size: int = 1
    """GPUs per engine (one engine per learner rank)."""
    gpus: list[int] | None = None
    """The node's GPUs for the engines, split evenly among its learner ranks in local-rank order
    (``tensor_parallel_size`` each at least); e.g. learner ranks on GPUs 0-3 and ``gpus: [4, 5, 6, 7]``. ``None``:
    vLLM's default device (on GPUs every engine then shares the learner's device)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Serving dtype; ``auto``: the learner's compute dtype (float32 for a float64 learner)."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA-graph capture (fast start; set false for long GPU runs)."""
    in_process: bool | None = None
    """Run vLLM's engine core inside the learner's process; ``None``: only with one learner rank and no ``gpus``
    or ``rollout.cpus`` placement (a learner's process group, or a placement, needs vLLM in its own process)."""


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
    """The node's CPU cores for rollout — the ``hf`` replicas or the ``vllm`` engine's threads, and the agent loop's
    threads — split evenly among the node's learner ranks (``None``: anywhere). Give the learner other cores
    (``learner.cpus``) so rollout and learner do not compete, as on separate GPUs."""
    vllm: VLLMSettings = field(default_factory=VLLMSettings)
    """The ``vllm`` engine: context length, GPUs and memory, dtype."""
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
    max_context_tokens: int | None = None
    """Longest context of a trajectory; a turn that would exceed it ends the trajectory (``context_limit``).
    ``None``: the policy's ``max_position_embeddings``."""
    reward_scheme: Literal["seta", "binary"] = "seta"


@dataclass
class WarmStartSettings:
    """A short supervised warm start on the tasks' reference solutions (0 steps: none)."""

    steps: int = 0
    lr: float = 3e-3
    near_misses: bool = True
    """Also demonstrate each task's plausible wrong command, so sampled groups carry a reward spread to learn from."""


PARTITIONED = ("deepspeed_stage_2", "deepspeed_stage_3", "fsdp")
"""Learner strategies that partition the optimizer state across ranks."""
SHARDED_PARAMETERS = ("deepspeed_stage_3", "fsdp")
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


def setting_problems(
    objective: str,
    schedule: str,
    context_backward: str,
    model: ModelSettings,
    rollout: RolloutSettings,
    learner,
    checkpoint: CheckpointSettings,
    resume: str | None,
) -> list[str]:
    """Every problem with ``fit``'s settings taken together, each naming the setting and the fix (empty: none)."""
    problems = []
    if context_backward == "boundary" and schedule != "thundersync":
        problems.append(
            f"context_backward 'boundary' streams context adjoints under schedule thundersync; schedule {schedule!r} "
            "runs the recompute learner (set context_backward: recompute)"
        )
    problems += learner.problems(schedule)
    if learner.strategy in PARTITIONED and (checkpoint.enabled or resume is not None):
        problems.append(
            f"learner.strategy {learner.strategy!r} partitions the optimizer state across ranks, which GPU-clock "
            "checkpoints (rank 0's replicated state) would lose: set checkpoint.enabled=false and no resume"
        )
    if learner.strategy in SHARDED_PARAMETERS and context_backward == "boundary":
        problems.append(
            f"learner.strategy {learner.strategy!r} serves sources in lock-step, one policy pass each; the boundary "
            "context backward runs several per source: set context_backward=recompute"
        )
    problems += _placement_problems(model, rollout, learner)
    if model.teacher_cpus is not None and objective != "opd":
        problems.append(f"model.teacher_cpus places the OPD teacher; objective {objective!r} has none (set it to null)")
    return problems


def _placement_problems(model: ModelSettings, rollout: RolloutSettings, learner) -> list[str]:
    """Node-wide core and GPU lists must split evenly among the node's learner ranks."""
    vllm = rollout.vllm
    problems = share_problems("learner.cpus", learner.cpus, learner.devices)
    problems += share_problems("rollout.cpus", rollout.cpus, learner.devices)
    problems += share_problems("model.teacher_cpus", model.teacher_cpus, learner.devices)
    problems += share_problems("rollout.vllm.gpus", vllm.gpus, learner.devices, vllm.tensor_parallel_size)
    if vllm.tensor_parallel_size < 1 or not 0 < vllm.gpu_memory_utilization <= 1:
        problems.append(
            "rollout.vllm.tensor_parallel_size must be >= 1 and rollout.vllm.gpu_memory_utilization in (0, 1]; got "
            f"{vllm.tensor_parallel_size}, {vllm.gpu_memory_utilization}"
        )
    placed = vllm.gpus is not None or (rollout.engine == "vllm" and rollout.cpus is not None)
    if vllm.in_process and (learner.world_size > 1 or placed):
        problems.append(
            "rollout.vllm.in_process: true needs one learner rank and no rollout.cpus / rollout.vllm.gpus placement "
            "(vLLM then starts a process group and binds threads inside the learner's process); set it to null"
        )
    for name in ("max_context_tokens",):
        value = getattr(rollout, name)
        if value is not None and value < 2:
            problems.append(f"rollout.{name} must be >= 2 or null; got {value}")
    if vllm.max_model_len is not None and vllm.max_model_len < 2:
        problems.append(f"rollout.vllm.max_model_len must be >= 2 or null; got {vllm.max_model_len}")
    return problems
