"""`tslightning bench`: its accounting on a hand-made run, and one small real run of two schedules side by side.

Timing figures belong to the benchmark itself; these tests check what it computes from a run's outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tslightning import cli
from tslightning.commands.bench import bench, format_table, measure_run, measure_runs

CONFIG = Path(__file__).parents[2] / "configs" / "bench_balanced.yaml"


def _write_run(run_dir: Path, steps: tuple[float, float, float] = (9.0, 3.0, 2.5), slower: float = 1.0) -> None:
    """A hand-made 3-update run; ``slower`` stretches every trace time (a machine running slower)."""
    (run_dir / "trace").mkdir(parents=True)
    (run_dir / "csv" / "version_0").mkdir(parents=True)
    (run_dir / "rewards.json").write_text(
        json.dumps({"step_seconds": list(steps), "mean_rewards": [0.0, 0.5, 1.0], "peak_learner_memory_mb": 321.0})
    )

    def source(update, ready, start, end, tokens=10):
        return {
            "record": "source", "update": update, "rank": 0, "ready_time": ready, "service_start": start,
            "service_end": end, "tokens": tokens,
        }  # fmt: skip

    def update(update, close, service, barrier, publication, end):
        return {
            "record": "update", "update": update, "rank": 0, "rollout_close": close, "learner_service_s": service,
            "barrier_s": barrier, "publication_s": publication, "update_end": end,
        }  # fmt: skip

    records = [
        source(0, 0.1, 5.0, 8.0),
        update(0, 4.0, 3.0, 0.5, 0.5, 9.0),  # the warm-up update: left out of every mean
        source(1, 0.4, 0.5, 1.0),
        source(1, 1.2, 1.5, 2.5),
        update(1, 2.0, 1.5, 0.2, 0.3, 3.0),
        source(2, 1.0, 1.0, 2.0),
        update(2, 1.5, 1.0, 0.25, 0.25, 2.5),
    ]
    timed = ("ready_time", "service_start", "service_end", "rollout_close", "learner_service_s", "barrier_s")
    timed += ("publication_s", "update_end")
    records = [{k: v * slower if k in timed else v for k, v in r.items()} for r in records]
    (run_dir / "trace" / "trace-rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (run_dir / "csv" / "version_0" / "metrics.csv").write_text(
        "perf/mfu/actor,staleness/max_policy_lag,staleness/mean_policy_lag,step\n"
        "0.1,,,0\n,0.0,0.0,0\n0.2,1.0,0.5,1\n0.4,,,2\n,1.0,1.0,2\n"
    )


def test_measure_run_accounts_over_the_updates_after_warmup(tmp_path):
    _write_run(tmp_path / "run")
    m = measure_run(tmp_path / "run", "thundersync", warmup=1)
    assert m.updates == 2 and m.step_s == pytest.approx(2.75) and m.mean_reward == pytest.approx(0.75)
    assert m.mfu == pytest.approx(0.3) and m.max_policy_lag == 1 and m.mean_policy_lag == pytest.approx(0.75)
    assert m.learner_service_s == pytest.approx(1.25) and m.rollout_close_s == pytest.approx(1.75)
    assert m.rollout_learner_ratio == pytest.approx(1.4) and m.peak_learner_memory_mb == 321.0
    # Lanes over 5.5 s of measured wall time: learner busy [0.5, 1], [1.5, 3] and [4, 5.5]; rollout [0, 2], [3, 4.5].
    assert m.learner_idle == pytest.approx(2.0 / 5.5) and m.rollout_idle == pytest.approx(2.0 / 5.5)
    # Eqs. 14-15 per measured update: sync ends 4.0 and 3.0, ThunderSync 2.7 and 2.5.
    assert m.predicted_speedup == pytest.approx(7.0 / 5.2)
    # Async estimates max(R, L) + P: max(2.0, 1.5) + 0.5 = 2.5 and max(1.5, 1.0) + 0.5 = 2.0.
    assert m.replay_vs_async == pytest.approx(5.2 / 4.5)
    assert m.speedup_vs_sync is None and "thundersync" in format_table([m])


def test_async_leaves_out_its_last_update_which_overlaps_no_rollout(tmp_path):
    _write_run(tmp_path / "run")
    m = measure_run(tmp_path / "run", "async", warmup=1)
    assert m.updates == 1 and m.step_s == pytest.approx(3.0)  # update 2 (2.5 s) had no next batch beside it
    with pytest.raises(ValueError, match="exceed warmup \\+ 1"):
        bench(str(CONFIG), ["sync", "async"], updates=2, warmup=1)


def test_measure_run_needs_updates_after_warmup(tmp_path):
    _write_run(tmp_path / "run")
    with pytest.raises(ValueError, match="warmup=3"):
        measure_run(tmp_path / "run", "sync", warmup=3)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"schedules": ["sometimes"]}, "sometimes"), ({"updates": 2, "warmup": 2}, "exceed warmup")]
)
def test_bench_rejects_bad_arguments_before_running(kwargs, match):
    with pytest.raises(ValueError, match=match):
        bench(str(CONFIG), **kwargs)


def test_latency_sweep_needs_a_simulated_tool_workload():
    with pytest.raises(ValueError, match="simulated tool latency"):
        bench("configs/quickstart.yaml", schedules=["sync"], latency_scales=[2.0])


def test_bench_runs_schedules_side_by_side_and_writes_json_and_pictures(tmp_path, capsys):
    small = [
        "--warm_start.steps=10",
        "--model.tiny.hidden_size=128",
        "--model.tiny.num_attention_heads=2",
        "--model.tiny.num_hidden_layers=1",
        "--model.tiny.intermediate_size=128",
        "--rollout.simulated_tool.median_latency_s=0.01",
        "--rollout.simulated_tool.max_latency_s=0.05",
        "--rollout.max_turns=2",
        "--rollout.max_tokens_per_turn=12",
    ]
    out = tmp_path / "bench"
    cli.main(
        ["bench", "--config", str(CONFIG), "--schedules", "sync,thundersync", "--updates", "2", "--warmup", "1"]
        + ["--out_dir", str(out), "--json", str(out / "bench.json"), "--fit_args", json.dumps(small)]
    )
    printed = capsys.readouterr().out
    assert "thundersync" in printed and "predicted-vs-measured.png" in printed
    sync, streamed = json.loads((out / "bench.json").read_text())
    assert (sync["schedule"], streamed["schedule"]) == ("sync", "thundersync")
    assert sync["speedup_vs_sync"] == 1.0 and sync["learner_service_vs_sync"] == 1.0
    assert streamed["speedup_vs_sync"] == pytest.approx(sync["step_s"] / streamed["step_s"])
    assert streamed["learner_service_vs_sync"] == pytest.approx(
        streamed["learner_service_s"] / sync["learner_service_s"]
    )
    for m in (sync, streamed):
        assert m["updates"] == 1 and m["max_policy_lag"] == 0 and m["step_s"] > 0 and m["learner_service_s"] > 0
        assert 0 <= m["learner_idle"] <= 1 and 0 <= m["rollout_idle"] <= 1 and m["predicted_speedup"] >= 1
        assert m["peak_learner_memory_mb"] > 0 and (Path(m["out_dir"]) / "trace").is_dir()
    for name in ("timeline-sync.png", "timeline-thundersync.png", "predicted-vs-measured.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ratio_sweep_scales_the_tool_and_reward_check_latencies_of_the_config():
    from tslightning.commands.bench import _config_latencies

    latencies = _config_latencies(str(CONFIG))
    assert set(latencies) == {"median_latency_s", "verify_median_latency_s"}
    assert latencies["median_latency_s"] > 0


def test_repeats_pool_every_update_and_keep_each_repeats_own_figures(tmp_path):
    _write_run(tmp_path / "a")
    _write_run(tmp_path / "b", steps=(9.0, 6.0, 5.0), slower=2.0)
    one, other = measure_run(tmp_path / "a", "sync", warmup=1), measure_run(tmp_path / "b", "sync", warmup=1)
    pooled = measure_runs([tmp_path / "a", tmp_path / "b"], "sync", warmup=1)
    assert pooled.repeats == 2 and pooled.updates == 4
    assert pooled.step_s == pytest.approx((3.0 + 2.5 + 6.0 + 5.0) / 4)
    assert pooled.step_s_per_repeat == pytest.approx((one.step_s, other.step_s))
    assert pooled.learner_service_s == pytest.approx((one.learner_service_s + other.learner_service_s) / 2)
    assert pooled.learner_service_s_per_repeat == pytest.approx((one.learner_service_s, other.learner_service_s))
    # the stretched run has twice the wall time: its idle fraction weighs twice as much
    assert pooled.learner_idle == pytest.approx((one.learner_idle + 2 * other.learner_idle) / 3)
    # replay endpoints pooled before the ratio; both runs predict the same speedup (one is the other, stretched)
    assert pooled.predicted_speedup == pytest.approx(one.predicted_speedup) == pytest.approx(other.predicted_speedup)
    assert pooled.replay_vs_async == pytest.approx(one.replay_vs_async) == pytest.approx(other.replay_vs_async)
    assert pooled.out_dir == str(tmp_path / "a")


def test_repeats_alternate_the_run_order_and_pair_ratios_repeat_by_repeat(tmp_path, monkeypatch):
    import tslightning.commands.bench as bench_module

    order = []
    step_of = {("sync", 0): 6.0, ("thundersync", 0): 3.0, ("sync", 1): 8.0, ("thundersync", 1): 5.0}

    def fake_fit(config, schedule, updates, run_dir, overrides):
        repeat = int(run_dir.name.rsplit("-rep", 1)[1])
        order.append((schedule, repeat))
        _write_run(run_dir, steps=(9.0, step_of[schedule, repeat], step_of[schedule, repeat]))

    monkeypatch.setattr(bench_module, "_run_fit", fake_fit)
    sync, streamed = bench(str(CONFIG), ["sync", "thundersync"], 3, 1, str(tmp_path), repeats=2)
    assert order == [("sync", 0), ("thundersync", 0), ("thundersync", 1), ("sync", 1)]  # ABBA
    assert streamed.repeats == 2 and streamed.step_s == pytest.approx(4.0) and sync.step_s == pytest.approx(7.0)
    assert streamed.speedup_vs_sync == pytest.approx(7.0 / 4.0)
    assert streamed.speedup_per_repeat == pytest.approx((2.0, 1.6))
    assert sync.speedup_per_repeat == pytest.approx((1.0, 1.0))
    assert "per repeat (run order alternates) speedup 2.000x, 1.600x" in format_table([sync, streamed])
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        bench(str(CONFIG), ["sync"], 3, 1, str(tmp_path), repeats=0)


def test_variants_run_every_schedule_each_with_its_overrides_and_own_sync(tmp_path, monkeypatch):
    import tslightning.commands.bench as bench_module

    runs = []
    step_of = {("sync", "off"): 8.0, ("thundersync", "off"): 5.0, ("async", "off"): 4.0}
    step_of |= {("sync", "spec"): 6.0, ("thundersync", "spec"): 3.0, ("async", "spec"): 3.5}

    def fake_fit(config, schedule, updates, run_dir, overrides):
        variant = run_dir.name.split("-", 1)[1]
        runs.append((schedule, variant, tuple(overrides)))
        _write_run(run_dir, steps=(9.0, step_of[schedule, variant], step_of[schedule, variant]))

    monkeypatch.setattr(bench_module, "_run_fit", fake_fit)
    variants = {"off": ["--rollout.server_urls=[http://a:1]"], "spec": ["--rollout.speculative.method=ngram"]}
    measured = bench(
        str(CONFIG), ["sync", "thundersync", "async"], 3, 1, str(tmp_path), overrides=["--x=1"], variants=variants
    )
    assert [(s, v) for s, v, _ in runs] == [(s, v) for v in ("off", "spec") for s in ("sync", "thundersync", "async")]
    assert all(overrides == ("--x=1", *variants[v]) for _, v, overrides in runs)
    by_run = {(m.schedule, m.variant): m for m in measured}
    assert by_run["thundersync", "spec"].speedup_vs_sync == pytest.approx(6.0 / 3.0)  # against sync of its variant
    table = format_table(measured)
    assert "thundersync-spec / async-off: 0.750x the step" in table and "tail/step" in table
    with pytest.raises(ValueError, match="variants"):
        bench(str(CONFIG), ["sync"], 3, 1, str(tmp_path), variants={"a b": []})
