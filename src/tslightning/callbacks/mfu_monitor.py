"""Trainer active MFU (Eq. 10) and the step-time breakdown of each update, under a Trainer or Fabric.

For update k, MFU_k = F_k^train / (T_k^step · Σ_d P_d) (App. B.1): the learner model FLOPs of the update (counted by
:mod:`tslightning.measure.learner_flops` from the architecture and each served source's token count), over the complete
update wall time times the peak FLOP/s of every learner device. The wall time starts when the update's
:class:`~tslightning.core.batch_registry.BatchPlan` arrives (its first rollout request) and ends after the publication
callbacks ordered before this one have had the replicas acknowledge θ_{k+1} (App. B.3); rollout waiting and idle
gaps stay in it. Each source is credited its own tokens: the padding of the ``sync`` schedule's micro-batches, which
App. B.1 would count as executed work, is left out, so every schedule is credited the same learner FLOPs.

The callback touches only what both a ``Trainer`` and a ``Fabric`` expose (``.strategy``, ``.global_rank``,
``.world_size``, ``.loggers``), like Lightning's ``SpikeDetection``. The peak comes from Lightning's
:func:`~lightning.fabric.utilities.throughput.get_available_flops` or an explicit override. Lightning's
:class:`~lightning.fabric.utilities.throughput.Throughput` averages FLOPs over a sliding time window (a ratio of
sums); Eq. 11 is the mean of per-update ratios over the updates after warm-up, so the monitor computes Eq. 10 per
update itself.
"""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype, get_available_flops

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed
from tslightning.measure.learner_flops import DecoderShape, WeightTraining, learner_flops


@dataclass(frozen=True)
class UpdateMeasurement:
    """One update's Eq. 10 terms and where its wall time went (seconds; FLOPs and tokens summed over ranks).

    Attributes:
        index: Position among the updates this monitor measured (the first ``warmup_updates`` are warm-up).
        policy_version: k, the version the update's batch was sampled and differentiated at.
        step_s: Complete update wall time T_k^step.
        rollout_wait_s: Time the learner waited for rollout (the loop's ``rollout_wait_s`` when it records one, else
            what the other phases leave of the step).
        learner_service_s: Learner forward/backward of the sources.
        barrier_s: Reduction, normalization, clipping and the optimizer step.
        publication_s: Publishing θ_{k+1} until the replicas acknowledged.
        learner_flops: F_k^train.
        num_tokens: Tokens the learner ran (context included).
        world_size: Learner devices.
        mfu: Eq. 10.
    """

    index: int
    policy_version: int
    step_s: float
    rollout_wait_s: float
    learner_service_s: float
    barrier_s: float
    publication_s: float
    learner_flops: float
    num_tokens: int
    world_size: int
    mfu: float

    @property
    def throughput(self) -> float:
        """Learner tokens per second per device over the complete step (verl's ``perf/throughput``)."""
        return self.num_tokens / (self.step_s * self.world_size)

    def metrics(self) -> dict[str, float]:
        """The measurement under verl's metric names."""
        return {
            "timing_s/step": self.step_s,
            "timing_s/gen": self.rollout_wait_s,
            "timing_s/update_actor": self.learner_service_s,
            "timing_s/barrier": self.barrier_s,
            "timing_s/update_weights": self.publication_s,
            "perf/mfu/actor": self.mfu,
            "perf/total_num_tokens": float(self.num_tokens),
            "perf/throughput": self.throughput,
        }


class MFUMonitor(L.Callback):
    """Measures and logs trainer active MFU (Eq. 10) and the step-time breakdown of every update.

    Order it after the :class:`~tslightning.callbacks.WeightPublisher`, so the step ends at the acknowledgement.

    Args:
        available_flops: Peak FLOP/s of one learner device. ``None`` reads Lightning's table for the strategy's root
            device and compute dtype; CPUs and chips missing from the table need it. The paper uses dense BF16:
            989.5e12 per H200, 2250e12 per B200 (App. B.4) — Lightning's H200 entries are the sparse figures.
        window: How many most recent updates the history keeps (and Eq. 11 averages); ``None`` keeps all.
        warmup_updates: Leading updates left out of :meth:`mean_mfu` and :meth:`mean_step_time` (startup, App. B.2).
    """

    def __init__(self, available_flops: float | None = None, window: int | None = None, warmup_updates: int = 0):
        problems = []
        if available_flops is not None and not (math.isfinite(available_flops) and available_flops > 0):
            problems.append(f"available_flops must be a positive FLOP/s figure or None; got {available_flops}")
        if window is not None and (not isinstance(window, int) or window < 1):
            problems.append(f"window must be an int >= 1 or None; got {window!r}")
        if not isinstance(warmup_updates, int) or warmup_updates < 0:
            problems.append(f"warmup_updates must be an int >= 0; got {warmup_updates!r}")
        if problems:
            raise ValueError("MFUMonitor: " + "; ".join(problems))
        self.available_flops = available_flops
        self.window = window
        self.warmup_updates = warmup_updates
        self.history: deque[UpdateMeasurement] = deque(maxlen=window)
        self._measured = 0
        self._peak: float | None = None
        self._start: float | None = None
        self._version = 0
        self._architecture: tuple[DecoderShape, WeightTraining] | None = None
        self._warned_peak = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(window=self.window, warmup_updates=self.warmup_updates)

    # ----------------------------------------------------------------- hooks (Trainer and Fabric)
    def on_train_batch_start(self, trainer: L.Trainer | L.Fabric, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """A :class:`BatchPlan` opens update k: the step's wall time starts (the peak is resolved first)."""
        if not isinstance(batch, BatchPlan):
            return
        if self._peak is None:
            self._peak = self._resolve_peak(trainer, pl_module)
        self._version = batch.policy_version
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer | L.Fabric, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """On :class:`BatchClosed` (stepped and published): measure, record and log update k."""
        if not isinstance(batch, BatchClosed) or self._start is None:
            return
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)  # queued kernels of the update belong to its wall time
        step_s = time.perf_counter() - self._start
        self._start = None
        measurement = self._measure(trainer, pl_module, step_s)
        self.history.append(measurement)
        self._measured += 1
        self._warn_if_above_peak(trainer, measurement)
        self._log(trainer, measurement)

    # ----------------------------------------------------------------- results
    def mean_mfu(self, after_warmup: bool = True) -> float:
        """Average trainer active MFU over the kept updates (Eq. 11)."""
        return _mean([m.mfu for m in self._window(after_warmup)])

    def mean_step_time(self, after_warmup: bool = True) -> float:
        """Mean step wall time over the kept updates; speedups are ratios of these means (Eq. 12)."""
        return _mean([m.step_s for m in self._window(after_warmup)])

    def state_dict(self) -> dict[str, Any]:
        return {"history": [asdict(m) for m in self.history], "measured": self._measured}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = deque((UpdateMeasurement(**m) for m in state_dict["history"]), maxlen=self.window)
        self._measured = state_dict["measured"]

    # ----------------------------------------------------------------- internals
    def _window(self, after_warmup: bool) -> list[UpdateMeasurement]:
        return [m for m in self.history if not after_warmup or m.index >= self.warmup_updates]

    def _measure(self, trainer: L.Trainer | L.Fabric, module: Any, step_s: float) -> UpdateMeasurement:
        timings = module.update_timings
        service = timings.get("learner_service_s", 0.0)
        barrier = timings.get("barrier_s", 0.0)
        publication = timings.get("publication_s", 0.0)
        wait = timings.get("rollout_wait_s", step_s - service - barrier - publication)
        shape, training = self._architecture_of(module)
        flops = sum(learner_flops(shape, record.tokens, training) for record in module.service_log)
        tokens = sum(record.tokens for record in module.service_log)
        flops, tokens = _sum_over_ranks(trainer, [float(flops), float(tokens)])
        mfu = flops / (step_s * self._peak * trainer.world_size)
        return UpdateMeasurement(
            index=self._measured,
            policy_version=self._version,
            step_s=step_s,
            rollout_wait_s=wait,
            learner_service_s=service,
            barrier_s=barrier,
            publication_s=publication,
            learner_flops=flops,
            num_tokens=round(tokens),
            world_size=trainer.world_size,
            mfu=mfu,
        )

    def _architecture_of(self, module: Any) -> tuple[DecoderShape, WeightTraining]:
        if self._architecture is None:  # the split is fixed for a run; reading it walks every parameter name
            policy = module.policy
            self._architecture = DecoderShape.from_config(policy.config), WeightTraining.from_model(policy)
        return self._architecture

    def _resolve_peak(self, trainer: L.Trainer | L.Fabric, module: Any) -> float:
        if self.available_flops is not None:
            return float(self.available_flops)
        device = trainer.strategy.root_device
        dtype = _compute_dtype(trainer, module)
        peak = get_available_flops(device, dtype)
        if not peak:
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            raise ValueError(
                f"MFUMonitor needs the peak FLOP/s of a learner device, but Lightning's get_available_flops has no "
                f"entry for {name!r} in {dtype}; pass MFUMonitor(available_flops=...) — FLOP/s per device, e.g. "
                "989.5e12 for an H200 or 2250e12 for a B200 in dense BF16 (App. B.4)"
            )
        return float(peak)

    def _warn_if_above_peak(self, trainer: L.Trainer | L.Fabric, measurement: UpdateMeasurement) -> None:
        """MFU above 1 means the learner ran faster than the declared peak: the peak is wrong, not the count."""
        if measurement.mfu <= 1.0 or self._warned_peak or trainer.global_rank != 0:
            return
        self._warned_peak = True
        achieved = measurement.learner_flops / (measurement.step_s * measurement.world_size)
        warnings.warn(
            f"MFUMonitor: update {measurement.policy_version} has MFU {measurement.mfu:.2f} > 1: the learner ran "
            f"{achieved:.3g} FLOP/s per device over the whole step, above the peak {self._peak:.3g} it divides by; "
            "set available_flops to the device's real peak (e.g. a CPU core's fp32 FMA width × clock)",
            stacklevel=2,
        )

    def _log(self, trainer: L.Trainer | L.Fabric, measurement: UpdateMeasurement) -> None:
        if trainer.global_rank != 0:
            return
        metrics = measurement.metrics()
        if self._window(after_warmup=True):
            metrics["perf/mfu/actor_avg"] = self.mean_mfu()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=measurement.policy_version)


def _compute_dtype(trainer: L.Trainer | L.Fabric, module: Any) -> torch.dtype:
    """The precision plugin's compute dtype, or the policy's own dtype when the plugin leaves it at full precision
    (a policy loaded in bfloat16 under the default ``32-true`` computes in bfloat16)."""
    strategy = trainer.strategy
    plugin = getattr(strategy, "precision_plugin", None) or getattr(strategy, "precision", None)
    try:
        dtype = _plugin_to_compute_dtype(plugin)
    except (RuntimeError, NotImplementedError):
        dtype = torch.float32
    return next(module.policy.parameters()).dtype if dtype == torch.float32 else dtype


def _sum_over_ranks(trainer: L.Trainer | L.Fabric, values: list[float]) -> list[float]:
    """Each rank served its own sources; F_k^train is their sum. (Fabric's strategy names it ``all_reduce``.)"""
    if trainer.world_size == 1:
        return values
    strategy = trainer.strategy
    reduce = getattr(strategy, "all_reduce", None) or strategy.reduce
    tensor = torch.tensor(values, dtype=torch.float64, device=strategy.root_device)
    return reduce(tensor, reduce_op="sum").tolist()


def _mean(values: list[float]) -> float:
    if not values:
        raise ValueError("no measured updates after warm-up yet; run more updates or lower warmup_updates")
    return sum(values) / len(values)
