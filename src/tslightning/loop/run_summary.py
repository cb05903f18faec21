"""What ``fit`` prints when it ends: how the reward moved, where the update's time went, where every output is, and
the commands to run next (validate, replay, resume).

The figures come from what the run measured: :class:`~tslightning.loop.updates.FitResult` (per-update reward, step
time, direction norm), the :class:`~tslightning.callbacks.MFUMonitor`'s step-time breakdown (App. B.3) and the release
trace's replay (Eqs. 14-16). Nothing is re-measured here.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tslightning.callbacks.checkpoint_state import checkpoint_dirs
from tslightning.loop.updates import FitResult

WINDOW = 5
"""Updates averaged at each end of the reward curve ("first 5 → last 5"; fewer when the run has under 10)."""


@dataclass(frozen=True)
class StepTimes:
    """Mean seconds per update of each phase (App. B.3), over the updates after the first (start-up)."""

    step_s: float
    rollout_wait_s: float | None = None
    """The learner waiting for ready sources (under ``thundersync`` the rest of rollout overlaps learner work)."""
    learner_service_s: float | None = None
    """Forward/backward of the sources."""
    barrier_s: float | None = None
    """Reduction, clipping and the optimizer step."""
    publication_s: float | None = None
    """Publishing θ_{k+1} until the replicas acknowledged it."""
    mfu: float | None = None
    """Trainer active MFU (Eq. 11)."""

    @classmethod
    def measured(cls, history: Sequence[Any], step_seconds: Sequence[float]) -> StepTimes:
        """From an :class:`~tslightning.callbacks.MFUMonitor`'s ``history`` (else the loop's step times alone)."""
        kept = list(history)[1:] or list(history)
        if not kept:
            return cls(step_s=_mean(list(step_seconds)[1:] or list(step_seconds)))
        return cls(
            step_s=_mean([m.step_s for m in kept]),
            rollout_wait_s=_mean_known([m.rollout_wait_s for m in kept]),
            learner_service_s=_mean_known([m.learner_service_s for m in kept]),
            barrier_s=_mean_known([m.barrier_s for m in kept]),
            publication_s=_mean_known([m.publication_s for m in kept]),
            mfu=_mean_known([m.mfu for m in kept]),
        )


@dataclass(frozen=True)
class RunSummary:
    """One finished ``fit`` run (or resumed segment), as the lines it prints."""

    result: FitResult
    objective: str
    schedule: str
    times: StepTimes
    first_update: int = 0
    """The update this segment started at (``--resume`` continues at k + 1)."""
    predicted_speedup: float | None = None
    """Trace replay's T_Sync / T_ThunderSync (Eq. 16), after the first update."""
    logs: list[str] = field(default_factory=list)
    """Where each logger wrote, with the command that opens it."""
    config_file: Path | None = None
    """This segment's resolved config (``out_dir/config.yaml``, or ``config.resume-<n>.yaml``)."""
    checkpoints: Path | None = None
    """The checkpoint directory (``None``: checkpoints are off)."""

    def text(self) -> str:
        """The summary: reward, timings, outputs and next commands, one item per line."""
        return "\n".join(
            [self._headline(), *self._reward_lines(), *self._time_lines(), *self._output_lines(), *self._next_lines()]
        )

    def _headline(self) -> str:
        updates = len(self.result.step_seconds)
        span = f"updates {self.first_update}-{self.first_update + updates - 1}" if updates else "no update"
        return (
            f"tslightning fit: {self.objective} ({self.schedule}), {span}, {_duration(sum(self.result.step_seconds))}"
        )

    def _reward_lines(self) -> list[str]:
        rewards = [r for r in self.result.mean_rewards if not math.isnan(r)]
        lines = []
        if rewards:
            window = max(1, min(WINDOW, len(rewards) // 2))  # the two ends never overlap
            first, last = _mean(rewards[:window]), _mean(rewards[-window:])
            lines.append(
                f"  mean reward     {first:.3f} (first {window}) → {last:.3f} (last {window}), {last - first:+.3f}; "
                f"per update {_curve(rewards)}"
            )
        if self.result.teacher_gaps:
            gaps = self.result.teacher_gaps
            lines.append(f"  teacher gap     {gaps[0]:+.3f} → {gaps[-1]:+.3f} (mean log π_T − log π_θ, rises toward 0)")
        if self.result.direction_norms:
            zero = sum(1 for norm in self.result.direction_norms if norm == 0.0)
            lines.append(
                f"  zero gradient   {zero} of {len(self.result.direction_norms)} updates (every group's rewards equal)"
            )
        return lines

    def _time_lines(self) -> list[str]:
        t = self.times
        phases = [
            ("waiting for rollout", t.rollout_wait_s),
            ("learner", t.learner_service_s),
            ("barrier + step", t.barrier_s),
            ("publication", t.publication_s),
        ]
        known = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases if seconds is not None)
        lines = [f"  step time       {t.step_s:.2f} s mean" + (f" ({known})" if known else "")]
        extra = []
        if self.predicted_speedup is not None:
            extra.append(f"trace replay predicts {self.predicted_speedup:.2f}x over sync (Eq. 16)")
        if t.mfu is not None:
            extra.append(f"MFU {100 * t.mfu:.2f}%")
        if extra:
            lines.append(f"                  {'; '.join(extra)}")
        return lines

    def _output_lines(self) -> list[str]:
        out = Path(self.result.out_dir)
        lines = [f"  outputs         {out}/"]
        latest = self._latest_checkpoint()
        if latest is not None:
            lines.append(f"    checkpoints   {latest.parent}/ (latest {latest.name})")
        lines += [f"    {'logs' if i == 0 else '':<13} {log}" for i, log in enumerate(self.logs)]
        if (out / "trace").is_dir():
            timeline = " and timeline.png" if (out / "timeline.png").is_file() else ""
            lines.append(f"    trace         {out / 'trace'}/{timeline}")
        if self.config_file is not None:
            lines.append(f"    config        {self.config_file} (re-run it with --config)")
        return lines

    def _next_lines(self) -> list[str]:
        out = shlex.quote(str(self.result.out_dir))
        lines = ["  next", f"    tslightning validate --checkpoint {out}    # final policy vs policy-0, train and dev"]
        if Path(self.result.out_dir, "trace").is_dir():
            lines.append(f"    tslightning replay --trace {out}/trace    # predicted sync vs thundersync step")
        latest = self._latest_checkpoint()
        if latest is not None and self.config_file is not None:
            more = self.first_update + len(self.result.step_seconds) + 10
            lines.append(
                f"    tslightning fit --config {shlex.quote(str(self.config_file))} --resume "
                f"{shlex.quote(str(latest))} --updates {more}    # continue training"
            )
        return lines

    def _latest_checkpoint(self) -> Path | None:
        found = checkpoint_dirs(self.checkpoints) if self.checkpoints is not None else []
        return found[-1] if found else None


def logger_locations(loggers: Sequence[Any]) -> list[str]:
    """Where each of ``fit``'s loggers wrote, with the command that opens it when there is one."""
    return [_location(logger) for logger in loggers]


def _location(logger: Any) -> str:
    name = type(logger).__name__
    if name == "TensorBoardLogger":
        return f"TensorBoard     {logger.log_dir} (tensorboard --logdir {shlex.quote(str(logger.root_dir))})"
    if name == "CSVLogger":
        return f"CSV             {Path(logger.log_dir) / 'metrics.csv'}"
    if name == "WandbLogger":
        return _wandb_location(logger)
    if name == "MLFlowLogger":
        uri = logger._tracking_uri or "mlruns"
        return f"MLflow          run {logger.run_id} in {uri} (mlflow ui --backend-store-uri {shlex.quote(str(uri))})"
    where = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None) or getattr(logger, "root_dir", None)
    return f"{name:<15} {where}" if where else name


def _wandb_location(logger: Any) -> str:
    run = logger.experiment
    if getattr(run.settings, "mode", None) == "offline" or getattr(run.settings, "_offline", False):
        directory = Path(run.dir).parent  # run.dir is the run's files/ folder
        return f"W&B (offline)   {directory} (wandb sync {shlex.quote(str(directory))})"
    return f"W&B             {run.url}"


def predicted_speedup(trace: Path) -> float | None:
    """The release trace's predicted T_Sync / T_ThunderSync after the first update (``None`` when there is too
    little trace to replay)."""
    from tslightning.measure.trace_replay import replay_trace

    try:
        summary = replay_trace(trace).summary(warmup=1)
    except (ValueError, ZeroDivisionError, StopIteration, FileNotFoundError):
        return None
    return summary["predicted_speedup"]


def _curve(values: Sequence[float], shown: int = 12) -> str:
    """The reward curve as numbers: every value, or ``shown`` evenly spaced ones of a long run."""
    if len(values) <= shown:
        return " ".join(f"{v:.2f}" for v in values)
    picks = [round(i * (len(values) - 1) / (shown - 1)) for i in range(shown)]
    return " ".join(f"{values[i]:.2f}" for i in picks) + f" ({shown} of {len(values)}, evenly spaced)"


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s of updates" if minutes else f"{rest}s of updates"


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _mean_known(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return _mean(known) if known else None
