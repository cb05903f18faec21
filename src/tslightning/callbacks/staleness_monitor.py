"""Policy lag per source (Fig. 2): k − the version that sampled the source, for the update computed at θ_k.

Zero-staleness schedules (``sync``, ``thundersync``) must see lag 0 for every source; ``async`` sees 1; under
``fully_async`` the lag varies and is bounded. The monitor logs it, keeps its histogram, and enforces the bound.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tslightning.callbacks.update_callback import UpdateCallback, module_name
from tslightning.core.sources import PolicyVersionError
from tslightning.learner.update_log import log_update_metrics
from tslightning.learner.update_result import ServiceRecord

_SHOWN = 8  # offending sources named in an error message


def policy_lags(records: Iterable[ServiceRecord], version: int) -> list[int]:
    """Policy lag ``version − record.policy_version`` of each served source of the update computed at θ_version."""
    return [version - record.policy_version for record in records]


class StalenessMonitor(UpdateCallback):
    """Logs per-update policy lag (``staleness/max_policy_lag``, ``staleness/mean_policy_lag``) and bounds it.

    Reads the module's ``service_log`` — each source's sampling ``policy_version`` (see
    :mod:`tslightning.callbacks.update_callback`) — when update k ends; a module without one is refused at the first
    hook, since a staleness bound that checks nothing would pass silently.

    Args:
        max_policy_lag: Largest lag allowed; 0 for the zero-staleness schedules, 1 for ``async``.
    """

    def __init__(self, max_policy_lag: int = 0) -> None:
        super().__init__()
        if not isinstance(max_policy_lag, int) or isinstance(max_policy_lag, bool) or max_policy_lag < 0:
            raise ValueError(
                f"StalenessMonitor: max_policy_lag must be an int >= 0 (0 for sync/thundersync, 1 for async); "
                f"got {max_policy_lag!r}"
            )
        self.max_policy_lag = max_policy_lag
        self.histogram: dict[int, int] = {}
        """Sources served per policy lag, over every update seen."""
        self.updates = 0

    @property
    def state_key(self) -> str:
        return self._generate_state_key(max_policy_lag=self.max_policy_lag)

    def check_host(self, trainer: Any, pl_module: Any) -> None:
        if getattr(pl_module, "service_log", None) is None:
            raise ValueError(
                f"StalenessMonitor needs the policy version that sampled each source of an update: give "
                f"{module_name(pl_module)} a `service_log` (records with policy_version, e.g. "
                "tslightning.ServiceRecord), or remove the callback"
            )

    def on_update_end(self, trainer: Any, pl_module: Any, k: int, batch: Any) -> None:
        """Record and log update k's lags, then enforce the bound.

        Raises:
            PolicyVersionError: If a source lags by more than ``max_policy_lag``, or was sampled by a newer policy
                than the one the update was computed at.
        """
        records = list(pl_module.service_log)
        lags = policy_lags(records, k)
        if not lags:
            return
        self._record(lags)
        metrics = {"staleness/max_policy_lag": float(max(lags)), "staleness/mean_policy_lag": sum(lags) / len(lags)}
        log_update_metrics(trainer, pl_module, metrics, step=k)
        self._check(records, lags, k)

    def _record(self, lags: list[int]) -> None:
        self.updates += 1
        for lag in lags:
            self.histogram[lag] = self.histogram.get(lag, 0) + 1

    def _check(self, records: list[ServiceRecord], lags: list[int], version: int) -> None:
        bad = [(r, lag) for r, lag in zip(records, lags, strict=True) if not 0 <= lag <= self.max_policy_lag]
        if not bad:
            return
        shown = ", ".join(
            f"({r.group_id!r}, trajectory {r.trajectory_index}"
            + ("" if r.turn_index is None else f", turn {r.turn_index}")
            + f") from θ_{r.policy_version}, lag {lag}"
            for r, lag in bad[:_SHOWN]
        )
        raise PolicyVersionError(
            f"update {version} used {len(bad)} source(s) outside policy lag [0, {self.max_policy_lag}]: {shown}"
            + (" ..." if len(bad) > _SHOWN else "")
            + "; raise max_policy_lag only for a schedule that allows that staleness"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"histogram": dict(self.histogram), "updates": self.updates}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.histogram = {int(lag): count for lag, count in state_dict["histogram"].items()}
        self.updates = state_dict["updates"]
