"""StalenessMonitor: lag 0 for zero-staleness updates, a clear error past max_policy_lag, histogram state."""

from __future__ import annotations

from dataclasses import replace

import lightning as L
import pytest
from harness import SMALL, MemoryLogger, fit, grpo_batch, grpo_batches

from tslightning.callbacks import StalenessMonitor
from tslightning.callbacks.staleness_monitor import policy_lags
from tslightning.core.sources import BatchClosed, PolicyVersionError
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.learner.update_log import write_update_row

SOURCES = SMALL.num_groups * SMALL.group_size


def lag_metrics(maximum: float, mean: float) -> dict[str, float]:
    return {"staleness/max_policy_lag": maximum, "staleness/mean_policy_lag": mean}


def lag_rows(logger: MemoryLogger) -> list[tuple[int | None, dict[str, float]]]:
    """The logged rows holding lags, reduced to the lag metrics (a row holds every metric of its update)."""
    return [(step, {k: row[k] for k in lag_metrics(0, 0)}) for step, row in logger.having("staleness/max_policy_lag")]


def test_trainer_reports_zero_lag(make_policy, vocab_size, tmp_path):
    monitor, logger, module = StalenessMonitor(), MemoryLogger(), StreamingPolicyModule(make_policy())
    fit(module, grpo_batches(vocab_size, 2), [monitor], tmp_path, logger=logger)
    assert module.policy_version == 2
    assert lag_rows(logger) == [(0, lag_metrics(0.0, 0.0)), (1, lag_metrics(0.0, 0.0))]
    assert [step for step, _ in logger.logged] == [0, 1]  # one row per update, through the logger connector
    assert monitor.histogram == {0: 2 * SOURCES} and monitor.updates == 2


def test_fabric_reports_lag_and_refuses_an_older_source(make_policy, vocab_size):
    strict, lenient, logger = StalenessMonitor(), StalenessMonitor(max_policy_lag=1), MemoryLogger()
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=[strict, lenient], loggers=[logger])
    module = StreamingPolicyModule(make_policy())
    wrapped, optimizer = fabric.setup(module, module.configure_optimizers())

    def update(k: int) -> None:
        for item in grpo_batch(vocab_size, k).stream():
            wrapped.ingest(item)
        wrapped.barrier(optimizer)

    def end_update(monitor: StalenessMonitor, k: int) -> None:
        monitor.on_train_batch_end(fabric, wrapped, None, BatchClosed(k), k)

    update(0)
    # Keywords, not positions: fabric.setup registers the LightningModule as a callback too.
    fabric.call(
        "on_train_batch_end", trainer=fabric, pl_module=wrapped, outputs=None, batch=BatchClosed(0), batch_idx=0
    )
    assert strict.histogram == lenient.histogram == {0: SOURCES}

    update(1)  # then the trace shows one source of update 1 sampled by θ_0
    module.service_log.append(replace(module.service_log[0], trajectory_index=9, policy_version=0))
    with pytest.raises(PolicyVersionError, match=r"update 1 used 1 source\(s\) outside policy lag \[0, 0\]: .*lag 1"):
        end_update(strict, 1)
    end_update(lenient, 1)
    write_update_row(fabric)  # the loop writes the update's one row
    assert strict.histogram == lenient.histogram == {0: 2 * SOURCES, 1: 1}
    assert lag_rows(logger)[-1] == (1, lag_metrics(1.0, 1 / (SOURCES + 1)))
    assert [step for step, _ in logger.logged] == [0, 1]

    module.service_log[-1] = replace(module.service_log[-1], policy_version=2)  # sampled by a policy not yet made
    with pytest.raises(PolicyVersionError, match=r"from θ_2, lag -1"):
        end_update(lenient, 1)


def test_state_round_trips_and_keys_by_bound():
    monitor = StalenessMonitor(max_policy_lag=1)
    monitor.load_state_dict({"histogram": {0: 12, 1: 3}, "updates": 2})
    restored = StalenessMonitor(max_policy_lag=1)
    restored.load_state_dict(monitor.state_dict())
    assert restored.state_dict() == {"histogram": {0: 12, 1: 3}, "updates": 2}
    assert restored.state_key == "StalenessMonitor{'max_policy_lag': 1}" != StalenessMonitor().state_key


def test_policy_lag_is_the_update_version_minus_the_sources(make_policy, vocab_size):
    module = StreamingPolicyModule(make_policy())
    for item in grpo_batch(vocab_size).stream():
        module.ingest(item)
    assert policy_lags(module.service_log, 2) == [2] * SOURCES


def test_negative_bound_is_rejected():
    with pytest.raises(ValueError, match="max_policy_lag must be an int >= 0"):
        StalenessMonitor(max_policy_lag=-1)
