"""The analytical speedup model of App. F (Eqs. 16-28): predicted Sync vs ThunderSync step time without a trace.

Time is normalized by W, the rollout time of one full wave of Q trajectories. A batch of B trajectories runs
w = max(1, B/Q) waves with learner service ρ_w·W per wave (Eq. 28), and a serial suffix κ_w·W (final reduction,
optimizer step, publication) closes the update. Sync serves all learner work after rollout; ThunderSync serves each
job once it is released, so only the learner tail λ_w of the last (ρ_w ≤ 1) or first (ρ_w > 1) wave outlasts
rollout (Eq. 25). The tail follows from the release fraction F(u) (Eq. 19): Eq. 22 for GRPO (a trajectory's work
waits for its reward, a closure share β for its whole group), Eq. 24 for OPD (a turns, each released when the
teacher scores it, a deferred share δ at trajectory completion). The speedup is Eq. 26 and never exceeds
Eq. 17's bound, itself at most 2.

The model is exact for its continuous release laws (no sampling noise); a measured release trace replays through
Eq. 14 instead (:mod:`tslightning.measure.trace_replay`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

Objective = Literal["grpo", "opd"]
OBJECTIVES: tuple[Objective, ...] = ("grpo", "opd")

# Bisection steps for Eq. 23's interior maximum: 2^-100 is far below float precision on [0, 1].
_BISECTION_STEPS = 100


@dataclass(frozen=True)
class SpeedupModelParameters:
    """App. F.5's parameters of the analytical sweeps (Figs. 7b, 9, 10); the defaults are the paper's."""

    capacity: int = 128
    """Q (trajectories): rollout capacity, the trajectories one full rollout wave runs at once."""
    group_size: int = 8
    """m (trajectories per group): GRPO group size; a closure share waits for all m rewards (Eq. 22)."""
    closure_fraction: float = 0.02
    """β (fraction of learner service, 0-1): GRPO service that waits for the whole group to close (Eq. 22)."""
    deferred_fraction: float = 0.45
    """δ (fraction of learner service, 0-1): OPD service deferred to trajectory completion (Eq. 24)."""
    service_exponent: float = 0.49
    """γ (dimensionless, ≥ 0): a trajectory completing at time u·W carries learner service ∝ u^γ (Eq. 21)."""
    suffix: float = 0.05
    """κ_w (units of W, the rollout time of one full wave): serial suffix after the last wave (Eq. 26)."""

    def problems(self) -> list[str]:
        """Every invalid field, each naming the field, its symbol and the fix (empty when valid)."""
        found = []
        if not _is_int(self.capacity) or self.capacity < 1:
            found.append(f"capacity (Q) must be an integer >= 1 trajectory; got {self.capacity!r}")
        if not _is_int(self.group_size) or self.group_size < 1:
            found.append(f"group_size (m) must be an integer >= 1 trajectory; got {self.group_size!r}")
        for name, symbol in (("closure_fraction", "β"), ("deferred_fraction", "δ")):
            value = getattr(self, name)
            if not _is_finite(value) or not 0 <= value <= 1:
                found.append(f"{name} ({symbol}) is a share of learner service: give a value in [0, 1]; got {value!r}")
        if not _is_finite(self.service_exponent) or self.service_exponent < 0:
            found.append(f"service_exponent (γ) must be a finite number >= 0; got {self.service_exponent!r}")
        if not _is_finite(self.suffix) or self.suffix < 0:
            found.append(f"suffix (κ_w) must be a finite number >= 0 (units of W); got {self.suffix!r}")
        return found


@dataclass(frozen=True)
class SpeedupPrediction:
    """One evaluation of Eqs. 19-28. Step times are in units of W, the rollout time of one full wave."""

    objective: Objective
    batch: int
    """B (trajectories per optimizer step)."""
    ratio: float
    """r: rollout time over learner time at full capacity."""
    turns: int
    """a: agentic turns per trajectory (only OPD's release law depends on it)."""
    waves: float
    """w = max(1, B/Q) (Eq. 28)."""
    learner_load: float
    """ρ_w = min(1, B/Q) / r: one wave's learner service over its rollout time (Eq. 28)."""
    release_lag: float
    """D = sup_u [u − F(u)]: the release law's lag behind uniform release, the tail at balance (Eq. 20)."""
    tail: float
    """λ_w: learner time left after a wave's rollout closes, in units of W (Eq. 19)."""
    sync_step: float
    """T_Sync / W = w(1 + ρ_w) + κ_w (Eq. 16 over w waves)."""
    thundersync_step: float
    """T_ThunderSync / W = w·max(1, ρ_w) + κ_w − [ρ_w − 1]_+ + λ_w (Eq. 26's denominator)."""
    speedup: float
    """S_Sync = T_Sync / T_ThunderSync (Eq. 26)."""
    bound: float
    """(R + L + P) / (max(R, L) + P): the speedup of complete overlap, ≤ 2 (Eq. 17)."""
    limit: float
    """(1 + ρ_w) / max(1, ρ_w): Eq. 26 as w → ∞ (App. F.3)."""
    parameters: SpeedupModelParameters = field(default_factory=SpeedupModelParameters)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """A few human-readable lines (what ``tslightning predict`` prints)."""
        return (
            f"tslightning predict: {self.objective.upper()}, B = {self.batch} trajectories/step, "
            f"r = T_rollout/T_train = {self.ratio:g}, a = {self.turns} turns\n"
            f"  waves w = {self.waves:.3f}   learner load ρ_w = {self.learner_load:.3f}   "
            f"suffix κ_w = {self.parameters.suffix:g}\n"
            f"  release lag D = {self.release_lag:.4f}   learner tail λ_w = {self.tail:.4f}\n"
            f"  step time (units of W)  sync {self.sync_step:.4f}   thundersync {self.thundersync_step:.4f}\n"
            f"  predicted speedup {self.speedup:.3f}x   (complete-overlap bound {self.bound:.3f}x, Eq. 17; "
            f"w → ∞ limit {self.limit:.3f}x)"
        )


def grpo_release_fraction(u: float, parameters: SpeedupModelParameters | None = None) -> float:
    """F_GRPO(u) = (1 − β)·u^(γ+1) + β·u^(γ+m): share of learner service released by u·W (Eq. 22)."""
    p = parameters or SpeedupModelParameters()
    gamma, beta = p.service_exponent, p.closure_fraction
    return (1 - beta) * u ** (gamma + 1) + beta * u ** (gamma + p.group_size)


def opd_release_fraction(u: float, turns: int, parameters: SpeedupModelParameters | None = None) -> float:
    """F_OPD(u) = (1 − δ)/a · Σ_j min(1, (a·u/j)^(γ+1)) + δ·u^(γ+1): turn j released at j·U/a (Eq. 24)."""
    p = parameters or SpeedupModelParameters()
    exponent = p.service_exponent + 1
    per_turn = sum(min(1.0, (turns * u / j) ** exponent) for j in range(1, turns + 1))
    return (1 - p.deferred_fraction) / turns * per_turn + p.deferred_fraction * u**exponent


def learner_tail(
    objective: Objective, learner_load: float, turns: int = 40, parameters: SpeedupModelParameters | None = None
) -> float:
    """λ = max(1, sup_{0≤u≤1} u + ρ[1 − F(u)]) − 1: learner time after rollout closes, in rollout times (Eq. 19).

    The expression under the supremum is concave in u wherever F is smooth, so its maximum is a stationary point
    (Eq. 23 for GRPO, closed form per turn interval for OPD) or an interval end; no grid is involved.
    """
    p = parameters or SpeedupModelParameters()
    _raise_if(_objective_problems(objective) + _load_problems(learner_load) + _turn_problems(turns) + p.problems())
    return _tail(objective, learner_load, turns, p)


def release_lag(objective: Objective, turns: int = 40, parameters: SpeedupModelParameters | None = None) -> float:
    """D = sup_{0≤u≤1} [u − F(u)], which equals the tail at balance, λ(ρ = 1) (Eq. 20)."""
    return learner_tail(objective, 1.0, turns, parameters)


def waves_and_load(batch: int, ratio: float, parameters: SpeedupModelParameters | None = None) -> tuple[float, float]:
    """Eq. 28's plotting approximation: w = max(1, B/Q) waves and learner load ρ_w = min(1, B/Q) / r."""
    p = parameters or SpeedupModelParameters()
    _raise_if(_batch_problems(batch) + _ratio_problems(ratio) + p.problems())
    return _waves_and_load(batch, ratio, p)


def predict_speedup(
    objective: Objective = "grpo",
    batch: int = 256,
    ratio: float = 1.0,
    turns: int = 40,
    parameters: SpeedupModelParameters | None = None,
) -> SpeedupPrediction:
    """Predicted Sync and ThunderSync step times and speedup of one workload (Eqs. 16-28, App. F.5 defaults).

    S_Sync(w) = [w(1 + ρ_w) + κ_w] / [w·max(1, ρ_w) + κ_w − [ρ_w − 1]_+ + λ_w]  (Eq. 26), with w and ρ_w from
    Eq. 28 and λ_w from Eq. 19 under Eq. 22 (GRPO) or Eq. 24 (OPD).

    Args:
        objective: ``grpo`` or ``opd``.
        batch: B, trajectories per optimizer step (≥ 1).
        ratio: r, rollout time over learner time at full capacity (> 0; 1 is balance).
        turns: a, agentic turns per trajectory (≥ 1; GRPO's prediction does not depend on it, App. F.2).
        parameters: App. F.5's parameters; ``None`` takes the paper's.

    Raises:
        ValueError: naming every invalid argument or parameter at once.
    """
    p = parameters or SpeedupModelParameters()
    _raise_if(
        _objective_problems(objective)
        + _batch_problems(batch)
        + _ratio_problems(ratio)
        + _turn_problems(turns)
        + p.problems()
    )
    waves, load = _waves_and_load(batch, ratio, p)
    tail = _tail(objective, load, turns, p)
    sync = waves * (1 + load) + p.suffix
    thundersync = waves * max(1.0, load) + p.suffix - max(load - 1, 0.0) + tail
    return SpeedupPrediction(
        objective=objective,
        batch=batch,
        ratio=ratio,
        turns=turns,
        waves=waves,
        learner_load=load,
        release_lag=_tail(objective, 1.0, turns, p),
        tail=tail,
        sync_step=sync,
        thundersync_step=thundersync,
        speedup=sync / thundersync,
        bound=sync / (waves * max(1.0, load) + p.suffix),
        limit=(1 + load) / max(1.0, load),
        parameters=p,
    )


def _waves_and_load(batch: int, ratio: float, p: SpeedupModelParameters) -> tuple[float, float]:
    occupancy = batch / p.capacity
    return max(1.0, occupancy), min(1.0, occupancy) / ratio


def _tail(objective: Objective, load: float, turns: int, p: SpeedupModelParameters) -> float:
    if objective == "grpo":
        return _grpo_supremum(load, p) - 1
    return _opd_supremum(load, turns, p) - 1


def _grpo_supremum(load: float, p: SpeedupModelParameters) -> float:
    """max(1, sup_u g(u)) for g(u) = u + ρ[1 − F_GRPO(u)], concave on [0, 1]; its stationary point solves Eq. 23."""
    gamma, beta, m = p.service_exponent, p.closure_fraction, p.group_size

    def slope(u: float) -> float:  # g'(u) = 1 − ρ·F'(u), nonincreasing in u
        return 1 - load * ((1 - beta) * (gamma + 1) * u**gamma + beta * (gamma + m) * u ** (gamma + m - 1))

    low, high = 0.0, 1.0
    for _ in range(_BISECTION_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if slope(middle) > 0 else (low, middle)
    candidates = (0.0, low, 1.0)
    return max(1.0, *(u + load * (1 - grpo_release_fraction(u, p)) for u in candidates))


def _opd_supremum(load: float, turns: int, p: SpeedupModelParameters) -> float:
    """max(1, sup_u g(u)) for g(u) = u + ρ[1 − F_OPD(u)], piecewise concave between the turn releases u = k/a.

    On [k/a, (k+1)/a] turns 1..k are fully released and F(u) = (1 − δ)k/a + c_k·u^(γ+1) with
    c_k = (1 − δ)/a · Σ_{j>k} (a/j)^(γ+1) + δ, so g'(u) = 0 at u = [ρ(γ+1)c_k]^(−1/γ) when that lies inside.
    """
    gamma, delta = p.service_exponent, p.deferred_fraction
    exponent = gamma + 1
    # suffix[k] = Σ_{j=k+1}^{a} (a/j)^(γ+1), built from the last turn backwards.
    suffix = [0.0] * (turns + 1)
    for j in range(turns, 0, -1):
        suffix[j - 1] = suffix[j] + (turns / j) ** exponent
    best = 1.0
    for k in range(turns):
        low, high = k / turns, (k + 1) / turns
        coefficient = (1 - delta) / turns * suffix[k] + delta
        released = (1 - delta) * k / turns
        candidates = [low, high]
        scale = load * exponent * coefficient  # g'(u) = 1 − scale·u^γ
        if gamma > 0 and scale * low**gamma < 1 < scale * high**gamma:  # interior stationary point, inside (0, 1)
            candidates.append(scale ** (-1 / gamma))
        best = max(best, *(u + load * (1 - released - coefficient * u**exponent) for u in candidates))
    return best


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _objective_problems(objective: object) -> list[str]:
    return [] if objective in OBJECTIVES else [f"objective must be 'grpo' or 'opd'; got {objective!r}"]


def _batch_problems(batch: object) -> list[str]:
    ok = _is_int(batch) and batch >= 1
    return [] if ok else [f"batch (B) must be an integer >= 1 trajectory per optimizer step; got {batch!r}"]


def _ratio_problems(ratio: object) -> list[str]:
    ok = _is_finite(ratio) and ratio > 0
    return [] if ok else [f"ratio (r = T_rollout/T_train) must be a finite number > 0 (1 is balance); got {ratio!r}"]


def _turn_problems(turns: object) -> list[str]:
    ok = _is_int(turns) and turns >= 1
    return [] if ok else [f"turns (a) must be an integer >= 1 agentic turn per trajectory; got {turns!r}"]


def _load_problems(load: object) -> list[str]:
    ok = _is_finite(load) and load >= 0
    return [] if ok else [f"learner_load (ρ = L/R) must be a finite number >= 0; got {load!r}"]


def _raise_if(problems: list[str]) -> None:
    if problems:
        raise ValueError("invalid speedup model input:\n  " + "\n  ".join(problems))
