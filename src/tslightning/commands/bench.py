"""`tslightning bench`: one workload under each schedule, side by side, in one run (App. B and F).

Every schedule runs the same ``tslightning fit`` config (same seed, tasks, model and placement) in its own process,
one after the other, so no run competes with another for cores. From each run's outputs — the release trace, the
CSV metrics and ``rewards.json`` — the bench reports, over the updates after ``warmup`` (App. B.3's window):

* mean step wall time, and the speedup vs ``sync`` as the ratio of mean step times (``async``'s last update is left
  out too: there is no next batch to roll out beside it, so it is not a steady-state step);
* trainer active MFU (Eq. 10, from :class:`~tslightning.callbacks.MFUMonitor`);
* learner service time per update (the sum of the learner's busy intervals) and its ratio to ``sync``'s;
* learner and rollout idle fractions of wall time (the Fig. 3 timeline's shares);
* policy lag, max and mean over trained sources;
* the learner process's peak memory;
* the trace-replay prediction (Eqs. 14-15): the ThunderSync speedup the run's own release trace predicts;
* the measured rollout/learner ratio r = mean rollout close R / mean learner service L;
* the rollout's tail (:mod:`tslightning.measure.rollout_tail`): τ from the 90th-percentile trajectory's ready time
  to the last one's, its share of the step, the tail's tokens per second, and speculative decoding's acceptance.

``variants`` runs every schedule once per named set of extra ``fit`` overrides (e.g. speculation off and on, each on
its own server), side by side in one table; each variant's speedups are against the sync run of the same variant.

A ratio sweep (``latency_scales``) reruns ``sync`` and ``thundersync`` with the simulated tool latency scaled, and
the Fig. 8-style scatter pairs each thundersync run's measured speedup with its trace-replay prediction.

On a shared machine the speed of a core drifts over minutes, and schedules run one after another, so a drift shows
up as a difference between schedules. ``repeats`` runs every schedule several times in alternating order (ABBA: forward,
then reversed, ...), which cancels a linear drift from the pooled means, and reports each repeat's own ratios
beside them, so the spread between repeats is visible next to the figure.
"""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from tslightning.measure.rollout_tail import rollout_tail
from tslightning.measure.timeline import busy_intervals, plot_timeline, utilization
from tslightning.measure.trace_file import read_trace
from tslightning.measure.trace_replay import replay_records

SCHEDULES = ("sync", "thundersync", "async", "fully_async")


@dataclass(frozen=True)
class ScheduleMeasurement:
    """One schedule's run, measured over the updates after the warm-up window (seconds unless named otherwise)."""

    schedule: str
    latency_scale: float
    updates: int
    """Updates measured (after warm-up)."""
    step_s: float
    """Mean step wall time: first rollout request to the replicas' acknowledgement of θ_{k+1} (loop time)."""
    speedup_vs_sync: float | None
    """Mean sync step time / mean step time of this schedule (ratio of means; ``None`` without a sync run)."""
    mfu: float
    """Mean trainer active MFU (Eq. 10) against the config's ``available_flops``."""
    learner_service_s: float
    """Mean learner busy time per update (per-source or micro-batch service, excluding the barrier)."""
    learner_service_vs_sync: float | None
    """``learner_service_s`` / sync's: what streaming costs the learner for the same work."""
    learner_idle: float
    """Fraction of wall time the learner lane is idle (measured updates)."""
    rollout_idle: float
    """Fraction of wall time the rollout lane is idle (measured updates)."""
    max_policy_lag: int
    mean_policy_lag: float
    peak_learner_memory_mb: float
    """Peak memory of the learner process: CUDA max allocated on a GPU, else the process's max resident set."""
    rollout_close_s: float
    """Mean R: when the update's last source became ready, from the first rollout request."""
    rollout_learner_ratio: float
    """Measured r = mean R / mean learner service (sync: the balance of the workload)."""
    predicted_speedup: float
    """ThunderSync speedup over Sync that this run's release trace predicts (Eqs. 14-15, ratio of means)."""
    replay_vs_async: float
    """This trace's replayed ThunderSync endpoint over its one-step-off async estimate max(R, L) + P (ratio of
    means): how close to async's step a zero-staleness learner serving every source the moment it is ready could
    come, given these ready times."""
    mean_reward: float
    out_dir: str
    """The first repeat's run directory (the timeline picture is drawn from it)."""
    repeats: int = 1
    """Runs pooled into this measurement (``bench(repeats=...)``); every mean above is over all their updates."""
    step_s_per_repeat: tuple[float, ...] = ()
    """Each repeat's own mean step time, in repeat order."""
    learner_service_s_per_repeat: tuple[float, ...] = ()
    """Each repeat's own mean learner service time, in repeat order."""
    speedup_per_repeat: tuple[float, ...] = ()
    """Sync's step / this schedule's step, repeat by repeat (the spread of ``speedup_vs_sync``)."""
    learner_service_vs_sync_per_repeat: tuple[float, ...] = ()
    """This schedule's learner service / sync's, repeat by repeat."""
    variant: str = ""
    """The variant (named set of extra ``fit`` overrides) this run used; ``""``: none."""
    tail_s: float = math.nan
    """Mean τ: the 90th-percentile trajectory's ready time to the last one's, per update."""
    tail_share: float = math.nan
    """Mean τ / mean step time."""
    tail_tokens_per_s: float = math.nan
    """Tokens per second of generation of the trajectories ready in the tail (pooled over the updates)."""
    acceptance_rate: float = math.nan
    """Speculative decoding's accepted / drafted tokens over the measured updates (``nan``: none speculated)."""


def bench(
    config: str,
    schedules: Sequence[str] = SCHEDULES,
    updates: int = 10,
    warmup: int = 2,
    out_dir: str = "runs/bench",
    latency_scales: Sequence[float] = (),
    overrides: Sequence[str] = (),
    repeats: int = 1,
    variants: Mapping[str, Sequence[str]] | None = None,
) -> list[ScheduleMeasurement]:
    """Run ``config`` under each schedule (and the sync/thundersync ratio sweep) and measure every run.

    Args:
        config: A ``tslightning fit`` config file.
        schedules: Schedules to compare (``sync`` first when present: speedups are relative to it).
        updates: Optimizer updates per run, warm-up included.
        warmup: Leading updates left out of every mean.
        out_dir: Each run writes to ``<out_dir>/<schedule>[-x<scale>]`` (``...-rep<i>`` with several repeats).
        latency_scales: Extra sync + thundersync runs with the ``simulated_tool`` median latencies (tool calls and
            reward check) multiplied by each scale (the rollout/learner ratio sweep).
        overrides: Further ``fit`` command-line overrides for every run (e.g. ``--rollout.replicas=2``).
        repeats: Runs of every schedule, in alternating order (forward, reversed, ...); each measurement pools them.
        variants: Named sets of further ``fit`` overrides; every schedule runs once per variant (``None``: one run
            with ``overrides`` only).
    """
    _check_arguments(schedules, updates, warmup, repeats, variants)
    base_latencies = _config_latencies(config) if latency_scales else {}
    variants = dict(variants) if variants else {"": []}
    runs = [(s, 1.0, v) for v in variants for s in schedules]
    runs += [(s, scale, "") for scale in latency_scales for s in ("sync", "thundersync")]
    run_dirs: dict[tuple[str, float, str], list[Path]] = defaultdict(list)
    for repeat in range(repeats):
        for schedule, scale, variant in runs if repeat % 2 == 0 else runs[::-1]:  # ABBA: a linear drift cancels
            name = _run_name(schedule, scale, variant=variant)
            run_dir = Path(out_dir) / (name if repeats == 1 else f"{name}-rep{repeat}")
            extra = [*overrides, *variants.get(variant, [])]
            if scale != 1.0:
                extra += [f"--rollout.simulated_tool.{key}={value * scale}" for key, value in base_latencies.items()]
            _run_fit(config, schedule, updates, run_dir, extra)
            run_dirs[schedule, scale, variant].append(run_dir)
    measured = [measure_runs(run_dirs[run], run[0], warmup, run[1], run[2]) for run in runs]
    return _with_sync_ratios(measured)


def measure_run(run_dir: str | Path, schedule: str, warmup: int, latency_scale: float = 1.0) -> ScheduleMeasurement:
    """Measure one finished ``fit`` run from its outputs (the trace, ``csv/`` metrics and ``rewards.json``)."""
    return measure_runs([run_dir], schedule, warmup, latency_scale)


def measure_runs(
    run_dirs: Sequence[str | Path], schedule: str, warmup: int, latency_scale: float = 1.0, variant: str = ""
) -> ScheduleMeasurement:
    """Measure repeats of one schedule together: means over every run's updates after ``warmup``, fractions of their
    pooled wall time, and the replay prediction as the ratio of the pooled replayed endpoints."""
    if not run_dirs:
        raise ValueError("measure_runs needs at least one run directory")
    cooldown = 1 if schedule == "async" else 0  # its last update overlaps no rollout: not a steady-state step
    runs = [_RunOutputs.read(Path(d), warmup, cooldown) for d in run_dirs]
    steps = [s for run in runs for s in run.steps]
    services = [s for run in runs for s in run.services]
    closes = [c for run in runs for c in run.closes]
    metrics = [m for run in runs for m in run.metrics]
    wall = sum(run.shares["wall_s"] for run in runs)
    lags = [m.get("staleness/max_policy_lag", 0.0) for m in metrics]
    mean_lags = [m.get("staleness/mean_policy_lag", 0.0) for m in metrics]
    service, close = _mean(services), _mean(closes)
    tails = [t for run in runs for t in run.tails]
    tail_generation = sum(t.tail_generation_s for t in tails)
    drafted = sum(t.drafted for t in tails)
    return ScheduleMeasurement(
        schedule=schedule,
        latency_scale=latency_scale,
        updates=len(steps),
        step_s=_mean(steps),
        speedup_vs_sync=None,
        mfu=_mean([m["perf/mfu/actor"] for m in metrics if "perf/mfu/actor" in m]),
        learner_service_s=service,
        learner_service_vs_sync=None,
        learner_idle=_pooled_share(runs, "learner_idle", wall),
        rollout_idle=_pooled_share(runs, "rollout_idle", wall),
        max_policy_lag=int(max(lags, default=0.0)),
        mean_policy_lag=_mean(mean_lags) if mean_lags else 0.0,
        peak_learner_memory_mb=max(run.peak_memory_mb for run in runs),
        rollout_close_s=close,
        rollout_learner_ratio=close / service if service > 0 else float("inf"),
        predicted_speedup=sum(e for run in runs for e in run.replay_sync)
        / sum(e for run in runs for e in run.replay_streamed),
        replay_vs_async=sum(e for run in runs for e in run.replay_streamed)
        / sum(e for run in runs for e in run.replay_async),
        mean_reward=_mean([r for run in runs for r in run.rewards]),
        out_dir=str(run_dirs[0]),
        repeats=len(runs),
        step_s_per_repeat=tuple(_mean(run.steps) for run in runs),
        learner_service_s_per_repeat=tuple(_mean(run.services) for run in runs),
        variant=variant,
        tail_s=_mean([t.tail_s for t in tails]),
        tail_share=_mean([t.tail_s for t in tails]) / _mean(steps),
        tail_tokens_per_s=sum(t.tail_tokens for t in tails) / tail_generation if tail_generation > 0 else math.nan,
        acceptance_rate=sum(t.accepted for t in tails) / drafted if drafted else math.nan,
    )


@dataclass(frozen=True)
class _RunOutputs:
    """What one ``fit`` run left, over its updates after the warm-up."""

    steps: list[float]
    services: list[float]
    closes: list[float]
    metrics: list[dict[str, float]]
    shares: dict[str, float]
    replay_sync: list[float]
    replay_streamed: list[float]
    replay_async: list[float]
    rewards: list[float]
    peak_memory_mb: float
    tails: list = ()

    @classmethod
    def read(cls, run_dir: Path, warmup: int, cooldown: int = 0) -> _RunOutputs:
        result = json.loads((run_dir / "rewards.json").read_text())
        steps = result["step_seconds"][warmup : len(result["step_seconds"]) - cooldown]
        if not steps:
            raise ValueError(
                f"{run_dir}: {len(result['step_seconds'])} update(s) leave none after warmup={warmup} and the last "
                f"{cooldown} (async's last update has no rollout beside it)"
            )
        records = read_trace(run_dir / "trace")
        kept = [r for r in records if r["update"] >= _first_version(records) + warmup]
        update_records = [r for r in kept if r["record"] == "update"]
        replay = replay_records(records)
        replay_sync, replay_streamed = replay.update_ends(warmup=warmup)
        return cls(
            steps=steps,
            services=[r["learner_service_s"] for r in update_records],
            closes=[r["rollout_close"] for r in update_records],
            metrics=_csv_metrics(run_dir)[warmup:],
            shares=utilization(busy_intervals(kept)),
            replay_sync=replay_sync,
            replay_streamed=replay_streamed,
            replay_async=replay.async_ends(warmup=warmup),
            rewards=result["mean_rewards"][warmup:],
            peak_memory_mb=result.get("peak_learner_memory_mb", float("nan")),
            tails=_tails([r for r in kept if r["record"] == "source"]),
        )


def _tails(sources: list[dict]) -> list:
    """Each measured update's rollout tail (every rank's sources of it together)."""
    by_update: dict[int, list[dict]] = defaultdict(list)
    for source in sources:
        by_update[source["update"]].append(source)
    return [rollout_tail(by_update[update]) for update in sorted(by_update)]


def _pooled_share(runs: Sequence[_RunOutputs], key: str, wall: float) -> float:
    """A lane's idle fraction of the runs' pooled wall time."""
    return sum(run.shares[key] * run.shares["wall_s"] for run in runs) / wall if wall > 0 else 0.0


def format_table(measurements: Sequence[ScheduleMeasurement]) -> str:
    """The side-by-side table ``tslightning bench`` prints."""
    header = (
        f"{'schedule':<18}{'step s':>8}{'speedup':>9}{'replay':>8}{'ts/as':>7}{'MFU':>8}{'learn s':>9}{'xsync':>7}"
        f"{'L idle':>8}{'R idle':>8}{'r':>6}{'lag':>9}{'peak MB':>9}{'reward':>8}"
    )
    lines = [header, "-" * len(header)]
    for m in measurements:
        name = _run_name(m.schedule, m.latency_scale, " x", m.variant)
        lines.append(
            f"{name:<18}{m.step_s:>8.3f}{_fmt(m.speedup_vs_sync, 'x'):>9}{m.predicted_speedup:>7.3f}x"
            f"{m.replay_vs_async:>6.3f}x"
            f"{m.mfu:>8.4f}{m.learner_service_s:>9.3f}{_fmt(m.learner_service_vs_sync, ''):>7}"
            f"{m.learner_idle:>8.2f}{m.rollout_idle:>8.2f}{m.rollout_learner_ratio:>6.2f}"
            f"{m.max_policy_lag:>4d}/{m.mean_policy_lag:<4.2f}{m.peak_learner_memory_mb:>9.0f}{m.mean_reward:>8.3f}"
        )
    for m in measurements:
        if m.repeats > 1 and m.speedup_per_repeat:
            name = _run_name(m.schedule, m.latency_scale, " x", m.variant)
            speedups = ", ".join(f"{x:.3f}x" for x in m.speedup_per_repeat)
            service = ", ".join(f"{x:.3f}" for x in m.learner_service_vs_sync_per_repeat)
            lines.append(f"{name}: per repeat (run order alternates) speedup {speedups}; learn s xsync {service}")
    lines.append(
        "step: mean step wall time; speedup: sync step / step (ratio of means); replay: ThunderSync speedup this "
        "run's release trace predicts; ts/as: that replay's ThunderSync step over the trace's async estimate "
        "max(R, L) + P (the floor against async for these ready times); learn s: learner service per update "
        "(xsync: vs sync); idle: fraction of wall time; r: rollout close / learner service; lag: max/mean policy lag"
    )
    return "\n".join(lines + tail_lines(measurements))


def tail_lines(measurements: Sequence[ScheduleMeasurement]) -> list[str]:
    """The rollout tail of each run, and every thundersync step against every async step (the zero-staleness floor
    against async, ``ts/as``, beside it)."""
    header = f"{'run':<26}{'tail s':>8}{'tail/step':>10}{'tail tok/s':>11}{'accepted':>9}{'ts/as floor':>12}"
    lines = ["", header, "-" * len(header)]
    for m in measurements:
        name = _run_name(m.schedule, m.latency_scale, " x", m.variant)
        accepted = "-" if math.isnan(m.acceptance_rate) else f"{m.acceptance_rate:.1%}"
        lines.append(
            f"{name:<26}{m.tail_s:>8.2f}{m.tail_share:>10.1%}{m.tail_tokens_per_s:>11.1f}{accepted:>9}"
            f"{m.replay_vs_async:>11.3f}x"
        )
    streamed = [m for m in measurements if m.schedule == "thundersync" and m.latency_scale == 1.0]
    stale = [m for m in measurements if m.schedule == "async" and m.latency_scale == 1.0]
    for t in streamed:
        for a in stale:
            lines.append(
                f"{_run_name(t.schedule, 1.0, variant=t.variant)} / {_run_name(a.schedule, 1.0, variant=a.variant)}: "
                f"{t.step_s / a.step_s:.3f}x the step (its trace's floor {t.replay_vs_async:.3f}x)"
            )
    lines.append(
        "tail: from the 90th-percentile trajectory's ready time to the last one's, per update; tail tok/s: tokens per "
        "second of generation of the trajectories ready in it; accepted: speculative decoding's accepted / drafted"
    )
    return lines


def write_pictures(measurements: Sequence[ScheduleMeasurement], out_dir: str | Path) -> list[Path]:
    """Fig. 3-style timelines per run and the Fig. 8-style predicted-vs-measured scatter; returns the PNG paths."""
    from tslightning.measure.speedup_plots import predicted_vs_measured_png

    out_dir = Path(out_dir)
    written = []
    for m in measurements:
        name = _run_name(m.schedule, m.latency_scale, variant=m.variant)
        path = out_dir / f"timeline-{name}.png"
        plot_timeline(Path(m.out_dir) / "trace", path, title=f"{name}: mean step {m.step_s:.2f} s")
        written.append(path)
    points = [
        (f"r={m.rollout_learner_ratio:.2f}", _sync_prediction(measurements, m), m.speedup_vs_sync)
        for m in measurements
        if m.schedule == "thundersync" and m.speedup_vs_sync is not None
    ]
    if points:
        written.append(predicted_vs_measured_png(points, out_dir / "predicted-vs-measured.png"))
    return written


def _sync_prediction(measurements: Sequence[ScheduleMeasurement], streamed: ScheduleMeasurement) -> float:
    """The prediction a thundersync point is compared with: the replay of the matching sync run's trace (its jobs
    released at their ready times), as Fig. 8 predicts from measured release traces."""
    sync = _matching_sync(measurements, streamed)
    return sync.predicted_speedup if sync is not None else streamed.predicted_speedup


def _with_sync_ratios(measured: list[ScheduleMeasurement]) -> list[ScheduleMeasurement]:
    out = []
    for m in measured:
        sync = _matching_sync(measured, m)
        if sync is None:
            out.append(m)
            continue
        values = asdict(m)
        values["speedup_vs_sync"] = sync.step_s / m.step_s
        values["learner_service_vs_sync"] = m.learner_service_s / sync.learner_service_s
        values["speedup_per_repeat"] = tuple(
            s / t for s, t in zip(sync.step_s_per_repeat, m.step_s_per_repeat, strict=True)
        )
        values["learner_service_vs_sync_per_repeat"] = tuple(
            t / s for s, t in zip(sync.learner_service_s_per_repeat, m.learner_service_s_per_repeat, strict=True)
        )
        out.append(ScheduleMeasurement(**values))
    return out


def _matching_sync(measured: Sequence[ScheduleMeasurement], m: ScheduleMeasurement) -> ScheduleMeasurement | None:
    return next(
        (s for s in measured if s.schedule == "sync" and s.latency_scale == m.latency_scale and s.variant == m.variant),
        None,
    )


def _run_fit(config: str, schedule: str, updates: int, run_dir: Path, overrides: list[str]) -> None:
    command = [
        sys.executable,
        "-m",
        "tslightning.cli",
        "fit",
        f"--config={config}",
        f"--schedule={schedule}",
        f"--updates={updates}",
        f"--out_dir={run_dir}",
        "--overwrite=true",  # a bench run directory holds the latest measurement of its schedule
        "--progress=false",
        *overrides,
    ]
    completed = subprocess.run(command, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(
            f"bench: `{' '.join(command)}` failed with exit code {completed.returncode}:\n{completed.stderr[-4000:]}"
        )


def _run_name(schedule: str, latency_scale: float, separator: str = "-x", variant: str = "") -> str:
    """A run's name: its schedule, with the latency scale of a ratio-sweep run and its variant."""
    name = schedule if latency_scale == 1.0 else f"{schedule}{separator}{latency_scale:g}"
    return f"{name}-{variant}" if variant else name


def _csv_metrics(run_dir: Path) -> list[dict[str, float]]:
    """Per-update metrics from the CSV logger (rows of one step merged), in step order."""
    files = sorted((run_dir / "csv").glob("version_*/metrics.csv"))
    if not files:
        raise FileNotFoundError(f"{run_dir}/csv holds no metrics.csv; was it written by tslightning fit?")
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    with files[-1].open() as file:
        for row in csv.DictReader(file):
            step = int(float(row["step"]))
            by_step[step].update({k: float(v) for k, v in row.items() if v not in ("", None) and k != "step"})
    return [by_step[s] for s in sorted(by_step)]


def _first_version(records: list[dict]) -> int:
    return min(r["update"] for r in records if r["record"] == "update")


def _config_latencies(config: str) -> dict[str, float]:
    """The config's simulated-tool median latencies a ratio sweep scales: tool calls and the reward check."""
    import yaml

    settings = yaml.safe_load(Path(config).read_text()) or {}
    rollout = settings.get("rollout") or {}
    if rollout.get("environment") != "simulated_tool":
        raise ValueError(
            f"latency_scales sweeps the simulated tool latency; {config} sets rollout.environment to "
            f"{rollout.get('environment', 'terminal')!r} (use a configs/bench_*.yaml)"
        )
    from tslightning.tasks.simulated_tool import SimulatedToolSettings

    tool = rollout.get("simulated_tool") or {}
    keys = ("median_latency_s", "verify_median_latency_s")
    return {key: float(tool.get(key, getattr(SimulatedToolSettings, key))) for key in keys}


def _check_arguments(
    schedules: Sequence[str], updates: int, warmup: int, repeats: int = 1, variants: Mapping | None = None
) -> None:
    unknown = [s for s in schedules if s not in SCHEDULES]
    if unknown or not schedules:
        raise ValueError(f"schedules {list(unknown) or '[]'} are not among {', '.join(SCHEDULES)}")
    if warmup < 0 or updates <= warmup:
        raise ValueError(f"updates ({updates}) must exceed warmup ({warmup}) >= 0, leaving updates to measure")
    if "async" in schedules and updates <= warmup + 1:
        raise ValueError(
            f"updates ({updates}) must exceed warmup + 1 ({warmup + 1}) with async: its last update rolls out no next "
            "batch beside it, so it is left out of the means"
        )
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 (runs of every schedule); got {repeats}")
    unnamed = [name for name in variants or {} if not re.fullmatch(r"[A-Za-z0-9_.]+", name)]
    if unnamed:
        raise ValueError(f"variants {unnamed} need names of letters, digits, '_' and '.' (they name run directories)")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _fmt(value: float | None, suffix: str) -> str:
    return "-" if value is None else f"{value:.3f}{suffix}"
