"""`tslightning verify`: replay recorded logical batches under sync and streaming, and measure the gap (App. G).

Protocol (App. G): record N logical batches, replay each under the batch-synchronous schedule and under
ThunderSync streaming (in a shuffled readiness order) from the same θ_0, compare the first batch direction
g_0 coordinate by coordinate (relative error, cosine), and after every update k the parameter gap

    Δ_k = ‖θ_k^stream − θ_k^sync‖ / ‖θ_k^sync − θ_0‖          (Eq. 30)

beside the paper's reference: the gap between a bfloat16-forward and a float32 sync run of the same batches.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch

from tslightning.core.batch_registry import Objective
from tslightning.core.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.learner.precision import compute_norms_in_float64
from tslightning.learner.streaming_module import Schedule, StreamingPolicyModule
from tslightning.measure.device_clock import synchronized_clock
from tslightning.models.tiny_model import TinyModelConfig, build_tiny_model, build_tokenizer

TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
"""Largest relative error of g_0 that ``verify`` accepts, per dtype (App. G)."""

DTypeName = Literal["float64", "float32"]


@dataclass
class VerifyReport:
    """Figures of one ``verify`` run; ``passed`` is what the exit status reports."""

    objective: str
    dtype: str
    updates: int
    seed: int
    num_sources_per_batch: list[int]
    first_direction_rel_error: float
    first_direction_cosine: float
    parameter_gap: list[float]
    """Δ_k streamed vs sync in ``dtype``, k = 1..updates (Eq. 30)."""
    bf16_reference_gap: list[float]
    """Δ_k of a bfloat16-forward sync run against a float32 sync run: the precision-of-training reference."""
    stream_seconds_per_source: float
    sync_seconds_per_source: float
    tolerance: float
    device: str = "cpu"
    """Where the four replays ran."""
    passed: bool = field(init=False)

    def __post_init__(self) -> None:
        self.passed = self.first_direction_rel_error <= self.tolerance

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        gaps = ", ".join(f"{g:.2e}" for g in self.parameter_gap)
        reference = ", ".join(f"{g:.2e}" for g in self.bf16_reference_gap)
        verdict = "PASS" if self.passed else "FAIL"
        return "\n".join(
            [
                f"tslightning verify: {self.objective} {self.dtype}, {self.updates} update(s), seed {self.seed}, "
                f"on {self.device}",
                f"  g_0 streamed vs sync: rel. error {self.first_direction_rel_error:.3e}, "
                f"cosine 1 - {1 - self.first_direction_cosine:.1e}  (tolerance {self.tolerance:.0e}) {verdict}",
                f"  parameter gap Δ_k streamed vs sync:  {gaps}",
                f"  reference Δ_k bf16 vs fp32 sync:     {reference}",
                f"  learner time per source: streamed {1e3 * self.stream_seconds_per_source:.1f} ms, "
                f"sync {1e3 * self.sync_seconds_per_source:.1f} ms (context recompute)",
            ]
        )


class _Replay:
    """One schedule replaying the recorded batches on its own copy of θ_0."""

    def __init__(
        self, policy: torch.nn.Module, objective: Objective, schedule: Schedule, precision: AbstractContextManager
    ) -> None:
        self.module = StreamingPolicyModule(policy, objective=objective, schedule=schedule)
        self.optimizer = self.module.configure_optimizers()
        self.precision = precision
        self.directions: list[torch.Tensor] = []
        self.seconds = 0.0
        self.sources = 0

    def update(self, batch: ReplayBatch) -> None:
        device = self.module.layout.parameters[0].device
        start = synchronized_clock(device)
        with self.precision:
            for item in batch.stream():
                self.module.ingest(item)
            result = self.module.barrier(self.optimizer)
        self.seconds += synchronized_clock(device) - start
        self.sources += result.num_sources
        self.directions.append(self.module.last_direction.double())

    def parameters(self) -> torch.Tensor:
        return self.module.layout.values(torch.float64)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.cpu(), b.cpu()
    return float((a - b).norm() / b.norm()) if bool(b.any()) else float((a - b).norm())


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.cpu(), b.cpu(), dim=0))


def _policy_copy(base: torch.nn.Module, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.nn.Module:
    policy = copy.deepcopy(base).to(device=device, dtype=dtype)
    if dtype == torch.float64:
        compute_norms_in_float64(policy)
    return policy


def _make_batches(
    objective: Objective, updates: int, seed: int, shape: WorkloadShape, base: torch.nn.Module, tokenizer
) -> list[ReplayBatch]:
    vocab = base.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    if objective is Objective.GRPO:
        return [synthetic_grpo_batch(vocab, k, generator, shape) for k in range(updates)]
    teacher = _policy_copy(build_tiny_model(TinyModelConfig(seed=seed + 1), tokenizer), torch.float64)
    return [synthetic_opd_batch(vocab, k, generator, teacher, shape) for k in range(updates)]


def _gaps(runs_a: list[torch.Tensor], runs_b: list[torch.Tensor], theta0: torch.Tensor) -> list[float]:
    return [float((a - b).norm() / (b - theta0).norm()) for a, b in zip(runs_a, runs_b, strict=True)]


def verify(
    objective: Objective = Objective.GRPO,
    dtype: DTypeName = "float64",
    updates: int = 3,
    seed: int = 0,
    shape: WorkloadShape | None = None,
    progress: Callable[[str], None] | None = None,
    device: str = "cpu",
) -> VerifyReport:
    """Replay ``updates`` synthetic logical batches under sync and streaming; see the module docstring.

    ``device`` is where the four replays (their policies, passes, statistics and steps) run, e.g. ``cuda``: the
    exactness of the device's kernels, float64 included. The batches are made on the host either way."""
    if updates < 1:
        raise ValueError(f"updates must be >= 1; got {updates}")
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {sorted(TOLERANCE)}; got {dtype!r}")
    objective, shape = Objective(objective), shape or WorkloadShape()
    tokenizer = build_tokenizer()
    base = build_tiny_model(TinyModelConfig(seed=seed), tokenizer)
    batches = _make_batches(objective, updates, seed, shape, base, tokenizer)
    torch_dtype, device = getattr(torch, dtype), torch.device(device)
    bf16 = torch.autocast(device.type, dtype=torch.bfloat16)
    runs = {
        "sync": _Replay(_policy_copy(base, torch_dtype, device), objective, Schedule.SYNC, nullcontext()),
        "stream": _Replay(_policy_copy(base, torch_dtype, device), objective, Schedule.THUNDERSYNC, nullcontext()),
        "fp32": _Replay(_policy_copy(base, torch.float32, device), objective, Schedule.SYNC, nullcontext()),
        "bf16": _Replay(_policy_copy(base, torch.float32, device), objective, Schedule.SYNC, bf16),
    }
    theta0 = runs["sync"].parameters()
    thetas: dict[str, list[torch.Tensor]] = {name: [] for name in runs}
    order = torch.Generator().manual_seed(seed + 10_000)
    for k, batch in enumerate(batches):
        for name, run in runs.items():
            run.update(batch.reordered(order) if name == "stream" else batch)
            thetas[name].append(run.parameters())
        if progress:
            progress(f"update {k + 1}/{updates} replayed under sync, thundersync, fp32 and bf16")
    g_stream, g_sync = runs["stream"].directions[0], runs["sync"].directions[0]
    return VerifyReport(
        objective=objective.value,
        dtype=dtype,
        updates=updates,
        seed=seed,
        num_sources_per_batch=[sum(1 for i in b.items if hasattr(i, "token_ids")) for b in batches],
        first_direction_rel_error=_relative_error(g_stream, g_sync),
        first_direction_cosine=_cosine(g_stream, g_sync),
        parameter_gap=_gaps(thetas["stream"], thetas["sync"], theta0),
        bf16_reference_gap=_gaps(thetas["bf16"], thetas["fp32"], theta0),  # θ_0 is float32-exact
        stream_seconds_per_source=runs["stream"].seconds / runs["stream"].sources,
        sync_seconds_per_source=runs["sync"].seconds / runs["sync"].sources,
        tolerance=TOLERANCE[dtype],
        device=str(device),
    )
