"""`fit`'s typed settings: the policy, the rollout pool and tasks, the warm start and checkpoints (jsonargparse derives
the CLI from these dataclasses and their attribute docstrings), and the checks run on them before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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
    if model.teacher_cpus is not None and objective != "opd":
        problems.append(f"model.teacher_cpus places the OPD teacher; objective {objective!r} has none (set it to null)")
    return problems
