"""Trainer active MFU (Eq. 10) and the step-time breakdown of each update, under a Trainer or Fabric.

For update k, MFU_k = F_k^train / (T_k^step · Σ_d P_d) (App. B.1): the learner model FLOPs of the update over the
complete update wall time times the peak FLOP/s of every learner device. The wall time starts when the update opens
(its :class:`~tslightning.core.batch_registry.BatchPlan`: its first rollout request; a plain module's batch start)
and ends after the :class:`~tslightning.callbacks.WeightPublisher` had the replicas acknowledge θ_{k+1} (App. B.3);
rollout waiting and idle gaps stay in it.

F_k^train comes the way Lightning's ``ThroughputMonitor`` takes it: a ``flops_fn(module)``, else the module's
``flops_per_batch`` attribute (e.g. from :func:`~lightning.fabric.utilities.throughput.measure_flops`), else — the
streaming module's default — counted by :mod:`tslightning.measure.learner_flops` from the architecture (the policy's
``config``) and each served source's token and scored-token counts in ``service_log`` (the LM head runs over the
scored rows only, :mod:`tslightning.objectives.scored_logprobs`). Each source is credited its own tokens: the
padding of the ``sync`` schedule's micro-batches, which App. B.1 would count as executed work, is left out, so every
schedule is credited the same learner FLOPs. Without any of these the monitor warns once and logs step times only.

The peak is an explicit override, else the dense peak of the device's chip (:mod:`tslightning.callbacks.peak_flops`:
its own table for current data-centre GPUs, then Lightning's
:func:`~lightning.fabric.utilities.throughput.get_available_flops`). A device neither table knows (a CPU, a new chip)
has MFU left out of the metrics, with one warning naming the override; training never fails for it.

Lightning's :class:`~lightning.fabric.utilities.throughput.Throughput` averages FLOPs over a sliding time window (a
ratio of sums); Eq. 11 is the mean of per-update ratios over the updates after warm-up, so the monitor computes
Eq. 10 per update itself.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning.fabric.utilities.throughput import _plugin_to_compute_dtype

from tslightning.callbacks.peak_flops import device_peak_flops
from tslightning.callbacks.update_callback import UpdateCallback, module_name, sum_over_ranks
from tslightning.learner.update_log import log_update_metrics
from tslightning.measure.device_clock import synchronized_clock
from tslightning.measure.learner_flops import DecoderShape, WeightTraining, learner_flops


@dataclass(frozen=True)
class UpdateMeasurement:
    """One update's Eq. 10 terms and where its wall time went (seconds; FLOPs and tokens summed over ranks).

    Attributes:
        index: Position among the updates this monitor measured (the first ``warmup_updates`` are warm-up).
        policy_version: k, the version the update's batch was sampled and differentiated at.
        step_s: Complete update wall time T_k^step.
        rollout_wait_s: Time the learner waited for rollout (the loop's ``rollout_wait_s`` when it records one, else
            what the other phases leave of the step); ``None`` when the module keeps no ``update_timings``.
        learner_service_s: Learner forward/backward of the sources (``None``: no ``update_timings``).
        barrier_s: Reduction, normalization, clipping and the optimizer step (``None``: no ``update_timings``).
        publication_s: Publishing θ_{k+1} until the replicas acknowledged (0 when nothing published it).
        learner_flops: F_k^train (``None``: no FLOP count, see the module docstring).
        num_tokens: Tokens the learner ran, context included (``None``: no ``service_log``).
        world_size: Learner devices.
        mfu: Eq. 10 (``None`` without F_k^train).
    """

    index: int
    policy_version: int
    step_s: float
    rollout_wait_s: float | None
    learner_service_s: float | None
    barrier_s: float | None
    publication_s: float
    learner_flops: float | None
    num_tokens: int | None
    world_size: int
    mfu: float | None

    @property
    def throughput(self) -> float | None:
        """Learner tokens per second per device over the complete step (verl's ``perf/throughput``)."""
        return None if self.num_tokens is None else self.num_tokens / (self.step_s * self.world_size)

    def metrics(self) -> dict[str, float]:
        """The measurement under verl's metric names (those it knows: ``None`` fields are left out)."""
        metrics = {
            "timing_s/step": self.step_s,
            "timing_s/gen": self.rollout_wait_s,
            "timing_s/update_actor": self.learner_service_s,
            "timing_s/barrier": self.barrier_s,
            "timing_s/update_weights": self.publication_s,
            "perf/mfu/actor": self.mfu,
            "perf/total_num_tokens": None if self.num_tokens is None else float(self.num_tokens),
            "perf/throughput": self.throughput,
        }
        return {name: value for name, value in metrics.items() if value is not None}


class MFUMonitor(UpdateCallback):
    """Measures and logs trainer active MFU (Eq. 10) and the step-time breakdown of every update.

    It reads the publication's timing from the :class:`~tslightning.callbacks.WeightPublisher`, so it refuses to come
    before one in the callbacks.

    Args:
        available_flops: Peak FLOP/s of one learner device. ``None`` reads the dense peak of the strategy's root
            device in its compute dtype (:mod:`~tslightning.callbacks.peak_flops`: e.g. 989.4e12 per H100/H200,
            2.25e15 per B200 in BF16, App. B.4); where no table knows the device (CPUs, new chips) MFU is not logged
            and the monitor warns once.
        window: How many most recent updates the history keeps (and Eq. 11 averages); ``None`` keeps all.
        warmup_updates: Leading updates left out of :meth:`mean_mfu` and :meth:`mean_step_time` (startup, App. B.2).
        flops_fn: This rank's learner FLOPs of the update that just stepped, given the LightningModule; ``None``
            reads the module's ``flops_per_batch``, else counts from the architecture (module docstring).
        name: Distinguishes several monitors in a checkpoint (their ``state_key``).
    """

    reads_publication = True

    def __init__(
        self,
        available_flops: float | None = None,
        window: int | None = None,
        warmup_updates: int = 0,
        flops_fn: Callable[[Any], float] | None = None,
        name: str | None = None,
    ):
        super().__init__()
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
        self.flops_fn = flops_fn
        self.name = name
        self.history: deque[UpdateMeasurement] = deque(maxlen=window)
        self._measured = 0
        self._peak: float | None = None
        self._start: float | None = None
        self._architecture: tuple[DecoderShape, WeightTraining] | None = None
        self._warned_peak = False

    @property
    def state_key(self) -> str:
        named = {} if self.name is None else {"name": self.name}
        return self._generate_state_key(window=self.window, warmup_updates=self.warmup_updates, **named)

    # ----------------------------------------------------------------- hooks (Trainer and Fabric)
    def on_update_start(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        """Update k opens: the step's wall time starts (the peak is resolved at the first update; 0.0: unknown)."""
        if self._peak is None:
            self._peak = self._resolve_peak(trainer, pl_module)
        self._start = synchronized_clock(trainer.strategy.root_device)

    def on_update_end(self, trainer: Any, pl_module: Any, k: int, batch: Any) -> None:
        """Update k stepped and was published: measure, record and log it."""
        if self._start is None:
            return
        step_s = synchronized_clock(trainer.strategy.root_device) - self._start  # its queued kernels included
        self._start = None
        measurement = self._measure(trainer, pl_module, k, step_s)
        self.history.append(measurement)
        self._measured += 1
        self._warn_if_above_peak(trainer, measurement)
        self._log(trainer, pl_module, measurement)

    # ----------------------------------------------------------------- results
    def mean_mfu(self, after_warmup: bool = True) -> float:
        """Average trainer active MFU over the kept updates (Eq. 11)."""
        return _mean([m.mfu for m in self._window(after_warmup) if m.mfu is not None])

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

    def _measure(self, trainer: Any, module: Any, k: int, step_s: float) -> UpdateMeasurement:
        publication = self.publication(trainer, module, k)
        publication_s = 0.0 if publication is None else publication.seconds  # 0: nothing was published
        timings = getattr(module, "update_timings", None)
        service = barrier = wait = None
        if isinstance(timings, dict):
            service, barrier = timings.get("learner_service_s", 0.0), timings.get("barrier_s", 0.0)
            wait = timings.get("rollout_wait_s", step_s - service - barrier - publication_s)
        records = getattr(module, "service_log", None)
        flops = self._flops(module)
        tokens = None if records is None else sum(record.tokens for record in records)
        summed = sum_over_ranks(trainer, [float(flops or 0.0), float(tokens or 0)])
        mfu = None if flops is None or not self._peak else summed[0] / (step_s * self._peak * trainer.world_size)
        return UpdateMeasurement(
            index=self._measured,
            policy_version=k,
            step_s=step_s,
            rollout_wait_s=wait,
            learner_service_s=service,
            barrier_s=barrier,
            publication_s=publication_s,
            learner_flops=None if flops is None else summed[0],
            num_tokens=None if tokens is None else round(summed[1]),
            world_size=trainer.world_size,
            mfu=mfu,
        )

    def _flops(self, module: Any) -> float | None:
        """This rank's F_k^train: ``flops_fn``, ``flops_per_batch``, or the architecture count (module docstring)."""
        if self.flops_fn is not None:
            return float(self.flops_fn(module))
        if getattr(module, "flops_per_batch", None) is not None:
            return float(module.flops_per_batch)
        records = getattr(module, "service_log", None)
        if records is not None and getattr(getattr(module, "policy", None), "config", None) is not None:
            shape, training = self._architecture_of(module)
            return float(sum(learner_flops(shape, record.tokens, training, record.scored_tokens) for record in records))
        self.warn_once(
            f"no FLOP count for {module_name(module)}: pass MFUMonitor(flops_fn=...) or give the module a "
            "`flops_per_batch` (as for Lightning's ThroughputMonitor); logging step times without MFU"
        )
        return None

    def _architecture_of(self, module: Any) -> tuple[DecoderShape, WeightTraining]:
        if self._architecture is None:  # the split is fixed for a run; reading it walks every parameter name
            policy = module.policy
            self._architecture = DecoderShape.from_config(policy.config), WeightTraining.from_model(policy)
        return self._architecture

    def _resolve_peak(self, trainer: Any, module: Any) -> float:
        """The peak FLOP/s of one learner device; 0.0 (after one warning) where no table knows the device."""
        if self.available_flops is not None:
            return float(self.available_flops)
        device = trainer.strategy.root_device
        dtype = _compute_dtype(trainer, module)
        peak = device_peak_flops(device, dtype)
        if peak is None:
            if trainer.global_rank != 0:
                return 0.0
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            self.warn_once(
                f"no peak FLOP/s known for {name!r} in {dtype}: MFU (perf/mfu/actor) is not logged; pass "
                "MFUMonitor(available_flops=...) (fit: available_flops) — FLOP/s per device, e.g. 989.4e12 for an "
                "H100/H200 or 2.25e15 for a B200 in dense BF16 (App. B.4)"
            )
            return 0.0
        return float(peak)

    def _warn_if_above_peak(self, trainer: Any, measurement: UpdateMeasurement) -> None:
        """MFU above 1 means the learner ran faster than the declared peak: the peak is wrong, not the count."""
        if measurement.mfu is None or measurement.mfu <= 1.0 or self._warned_peak or trainer.global_rank != 0:
            return
        self._warned_peak = True
        achieved = measurement.learner_flops / (measurement.step_s * measurement.world_size)
        warnings.warn(
            f"MFUMonitor: update {measurement.policy_version} has MFU {measurement.mfu:.2f} > 1: the learner ran "
            f"{achieved:.3g} FLOP/s per device over the whole step, above the peak {self._peak:.3g} it divides by; "
            "set available_flops to the device's real peak (e.g. a CPU core's fp32 FMA width × clock)",
            stacklevel=2,
        )

    def _log(self, trainer: Any, module: Any, measurement: UpdateMeasurement) -> None:
        metrics = measurement.metrics()
        if measurement.mfu is not None and self._window(after_warmup=True):
            metrics["perf/mfu/actor_avg"] = self.mean_mfu()
        log_update_metrics(trainer, module, metrics, step=measurement.policy_version, prog_bar=["perf/mfu/actor"])


def _compute_dtype(trainer: Any, module: Any) -> torch.dtype:
    """The precision plugin's compute dtype, or the policy's (else the module's) own dtype when the plugin leaves it
    at full precision (a policy loaded in bfloat16 under the default ``32-true`` computes in bfloat16)."""
    strategy = trainer.strategy
    plugin = getattr(strategy, "precision_plugin", None) or getattr(strategy, "precision", None)
    try:
        dtype = _plugin_to_compute_dtype(plugin)
    except (RuntimeError, NotImplementedError):
        dtype = torch.float32
    if dtype != torch.float32:
        return dtype
    parameter = next(getattr(module, "policy", module).parameters(), None)
    return torch.float32 if parameter is None else parameter.dtype


def _mean(values: list[float]) -> float:
    if not values:
        raise ValueError("no measured updates after warm-up yet; run more updates or lower warmup_updates")
    return sum(values) / len(values)
