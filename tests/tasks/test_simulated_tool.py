"""The benchmark's simulated-tool environment: seeded, heterogeneous, and scored by the number of gauge reads."""

from __future__ import annotations

import time

import pytest

from tslightning.tasks.simulated_tool import (
    GAUGE_COMMAND,
    SimulatedToolAttempt,
    SimulatedToolEnvironment,
    SimulatedToolSettings,
    gauge_demonstrations,
    gauge_reward,
    simulated_tasks,
)


def settings(**overrides) -> SimulatedToolSettings:
    values = {"median_latency_s": 0.002, "latency_sigma": 0.8, "max_latency_s": 0.05, **overrides}
    return SimulatedToolSettings(**values)


def test_tasks_cycle_through_call_targets():
    tasks = simulated_tasks(settings(num_tasks=6, max_calls=4))
    assert [t.target_calls for t in tasks] == [1, 2, 3, 4, 1, 2]
    assert tasks[2].task_id == tasks[2].group_id == "gauge-2" and "3 times" in tasks[2].instruction
    assert "once" in tasks[0].instruction


@pytest.mark.parametrize(
    ("calls", "target", "reward"), [(2, 2, 1.5), (1, 2, 0.5), (3, 2, 0.5), (4, 2, 0.0), (9, 2, 0.0), (0, 1, 0.0)]
)
def test_reward_is_seta_on_closeness_to_the_target(calls, target, reward):
    assert gauge_reward(calls, target) == reward


def test_attempts_are_seeded_by_task_and_ordinal_and_vary_between_them():
    task = simulated_tasks(settings())[3]
    first, second = SimulatedToolEnvironment(settings()), SimulatedToolEnvironment(settings())
    a0, a1 = first(task), first(task)
    b0 = second(task)
    outputs_a0 = [a0.run_command(GAUGE_COMMAND).output for _ in range(3)]
    outputs_b0 = [b0.run_command(GAUGE_COMMAND).output for _ in range(3)]
    outputs_a1 = [a1.run_command(GAUGE_COMMAND).output for _ in range(3)]
    assert outputs_a0 == outputs_b0  # same (seed, task, ordinal): same readings and latencies
    assert a0.tool_seconds == b0.tool_seconds
    assert outputs_a0 != outputs_a1 and a0.tool_seconds != a1.tool_seconds  # the next attempt differs
    lengths = {len(o) for o in outputs_a0 + outputs_a1}
    assert len(lengths) > 1  # observation lengths vary
    assert a0.verify() == gauge_reward(3, task.target_calls)


def test_attempt_sigma_spreads_whole_attempts():
    task = simulated_tasks(settings())[0]
    spread = SimulatedToolEnvironment(settings(latency_sigma=0.0, attempt_latency_sigma=1.0))
    scales = [spread(task).latency_scale for _ in range(20)]
    assert min(scales) < 0.6 and max(scales) > 1.6
    attempt = spread(task)
    attempt.run_command(GAUGE_COMMAND)
    assert attempt.tool_seconds == pytest.approx(min(0.05, 0.002 * attempt.latency_scale))
    assert SimulatedToolEnvironment(settings())(task).latency_scale == 1.0


def test_a_call_sleeps_its_latency_within_the_cap():
    attempt = SimulatedToolEnvironment(settings(median_latency_s=0.02, latency_sigma=0.0, max_latency_s=0.02))(
        simulated_tasks(settings())[0]
    )
    start = time.perf_counter()
    attempt.run_command(GAUGE_COMMAND)
    assert time.perf_counter() - start >= 0.02 and attempt.tool_seconds == pytest.approx(0.02)


def test_the_reward_check_sleeps_a_seeded_latency_independent_of_the_reads():
    config = settings(verify_median_latency_s=0.01, verify_latency_sigma=1.0, max_verify_latency_s=0.03)
    env = SimulatedToolEnvironment(config)
    task = simulated_tasks(config)[0]
    attempts = [env(task) for _ in range(12)]
    for attempt in attempts[:6]:
        attempt.run_command(GAUGE_COMMAND)
    waits = []
    for attempt in attempts:
        before = attempt.tool_seconds
        attempt.verify()
        waits.append(attempt.tool_seconds - before)
    assert all(0 < w <= 0.03 for w in waits) and len(set(waits)) > 3  # spread, capped
    again = SimulatedToolEnvironment(config)(task)
    again.verify()
    assert again.tool_seconds == waits[0]  # a pure function of (seed, task, ordinal)
    immediate = SimulatedToolEnvironment(settings())(task)
    assert immediate.verify() == 0.0 and immediate.tool_seconds == 0.0


def test_other_commands_fail_and_do_not_count_as_reads():
    attempt = SimulatedToolEnvironment(settings())(simulated_tasks(settings())[0])
    outcome = attempt.run_command("ls /app")
    assert outcome.exit_code == 127 and "command not found" in outcome.output
    assert attempt.calls == 0 and attempt.commands == 1 and attempt.verify() == 0.0


def test_demonstrations_solve_each_task_with_near_misses():
    tasks = simulated_tasks(settings(num_tasks=2, max_calls=2))
    demos = gauge_demonstrations(tasks, settings(), near_misses=True)
    reads = sorted((d.instruction, sum(GAUGE_COMMAND in a for a, _ in d.turns)) for d in demos)
    assert reads == sorted(
        [(tasks[0].instruction, 1), (tasks[0].instruction, 2), (tasks[1].instruction, 2)]
        + [(tasks[1].instruction, 1), (tasks[1].instruction, 3)]
    )
    assert all(d.turns[-1][0] == "<finish/>" for d in demos)
    assert sorted(sum(GAUGE_COMMAND in a for a, _ in d.turns) for d in demos if d.reference) == [1, 2]
    assert len(gauge_demonstrations(tasks, settings(), near_misses=False)) == 2


def test_demonstration_readings_have_the_lengths_the_tool_returns():
    """The warm start shows the observations rollouts will see, not a shorter stand-in."""
    config = settings(min_reading_chars=20, max_reading_chars=30)
    demos = gauge_demonstrations(simulated_tasks(config), config)
    readings = [obs.split("\n")[0] for demo in demos for action, obs in demo.turns if GAUGE_COMMAND in action]
    lengths = {len(r.split(": ", 1)[1]) for r in readings}
    assert min(lengths) >= 20 and max(lengths) <= 30 and len(lengths) > 1
    outcome = SimulatedToolEnvironment(config)(simulated_tasks(config)[0]).run_command(GAUGE_COMMAND)
    assert 20 <= len(outcome.output.split(": ", 1)[1]) <= 30


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_tasks", 0),
        ("max_calls", 0),
        ("median_latency_s", -1.0),
        ("max_latency_s", 0.0001),
        ("max_reading_chars", 1),
        ("verify_median_latency_s", -1.0),
        ("verify_latency_sigma", -0.5),
    ],
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):
        settings(**{field: value, **({"median_latency_s": 0.01} if field == "max_latency_s" else {})})


def test_a_manual_of_the_given_length_opens_every_instruction():
    tasks = simulated_tasks(settings(manual_chars=700))
    manual = tasks[0].instruction.split("\n\n")[0]
    assert len(manual) == 700 and GAUGE_COMMAND in manual
    assert all(t.instruction.startswith(manual) for t in tasks)
    assert tasks[1].instruction.endswith("Read the gauge 2 times with read-gauge, then finish.")
    assert simulated_tasks(settings())[0].instruction == "Read the gauge once with read-gauge, then finish."


def test_long_tail_stragglers_take_about_half_of_the_rollout():
    """The balanced bench workload's latencies with ``arrival: long_tail``: about 10% of attempts are stragglers, and
    in a batch of 32 the 90th-percentile attempt's tool time is about half the slowest one's (mean over 40 batches)."""
    bench = {"num_tasks": 8, "max_calls": 4, "median_latency_s": 0.25, "latency_sigma": 0.5, "max_latency_s": 1.5}
    long_tail = SimulatedToolSettings(**bench, arrival="long_tail")
    tasks = simulated_tasks(long_tail)
    ratios, stragglers = [], 0
    for batch in range(40):
        attempts = [SimulatedToolAttempt(t, long_tail, 4 * batch + i) for t in tasks for i in range(4)]
        stragglers += sum(a.straggler for a in attempts)
        times = sorted(sum(a.call_latency(c) for c in range(a.task.target_calls)) for a in attempts)
        ratios.append(times[int(0.9 * len(times)) - 1] / times[-1])
    assert 0.05 <= stragglers / (40 * 32) <= 0.15
    assert 0.4 <= sum(ratios) / len(ratios) <= 0.6


def test_a_straggler_calls_take_the_tail_factor_longer_and_waves_has_none():
    task = simulated_tasks(settings())[2]
    waves = SimulatedToolSettings(median_latency_s=0.2, latency_sigma=0.5, max_latency_s=0.3)
    long_tail = SimulatedToolSettings(
        median_latency_s=0.2, latency_sigma=0.5, max_latency_s=0.3, arrival="long_tail", tail_fraction=1.0
    )
    plain, straggler = SimulatedToolAttempt(task, waves, 0), SimulatedToolAttempt(task, long_tail, 0)
    assert not plain.straggler and straggler.straggler
    for call in range(3):
        assert straggler.call_latency(call) == pytest.approx(2.5 * plain.call_latency(call))  # the cap scales too
    assert not any(SimulatedToolAttempt(task, waves, o).straggler for o in range(50))


@pytest.mark.parametrize(("field", "value"), [("tail_fraction", 1.5), ("tail_latency_factor", 0.5)])
def test_bad_tail_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        settings(**{field: value})


def test_long_decode_logs_the_reads_of_a_seeded_share_of_the_tasks():
    profile = settings(num_tasks=20, arrival="long_decode", tail_fraction=0.1)
    tasks = simulated_tasks(profile)
    logging = [t for t in tasks if t.log_note]
    assert len(logging) == 2 and logging == [t for t in simulated_tasks(profile) if t.log_note]  # seeded
    assert [
        t.task_id for t in simulated_tasks(settings(num_tasks=20, arrival="long_decode", seed=1)) if t.log_note
    ] != [t.task_id for t in logging]
    assert len(logging[0].log_note) == 72 and f'{GAUGE_COMMAND} --log "{logging[0].log_note}"' in logging[0].instruction
    assert len([t for t in simulated_tasks(settings(num_tasks=4, arrival="long_decode")) if t.log_note]) == 1
    assert not any(t.log_note for t in simulated_tasks(settings(num_tasks=20, arrival="long_tail")))


def test_a_logging_trajectory_generates_about_two_and_a_half_times_the_tokens():
    from tslightning.models.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    profile = settings(num_tasks=8, arrival="long_decode")
    plain_profile = settings(num_tasks=8)
    for logging, plain in zip(simulated_tasks(profile), simulated_tasks(plain_profile), strict=True):
        if not logging.log_note:
            continue
        (long_demo,) = gauge_demonstrations([logging], profile, near_misses=False)
        (short_demo,) = gauge_demonstrations([plain], plain_profile, near_misses=False)
        generated = [sum(len(tokenizer.encode(a)) + 1 for a, _ in demo.turns) for demo in (long_demo, short_demo)]
        assert 2.2 <= generated[0] / generated[1] <= 3.0, generated


def test_a_logging_read_counts_however_the_note_was_copied_and_latencies_are_unchanged():
    profile = settings(num_tasks=8, arrival="long_decode", tail_fraction=1.0)
    task = simulated_tasks(profile)[1]  # two reads
    attempt = SimulatedToolAttempt(task, profile, 0)
    attempt.run_command(task.read_command)
    attempt.run_command(f'{GAUGE_COMMAND} --log "The read-gau')  # a garbled copy is still a read
    assert attempt.run_command("ls").exit_code == 127
    assert attempt.calls == 2 and attempt.verify() == 1.5
    plain = SimulatedToolAttempt(simulated_tasks(settings(num_tasks=8))[1], settings(num_tasks=8), 0)
    assert [attempt.call_latency(c) for c in range(3)] == [plain.call_latency(c) for c in range(3)]
    strict = SimulatedToolAttempt(simulated_tasks(settings(num_tasks=8))[2], settings(num_tasks=8), 0)
    assert strict.run_command(f"{GAUGE_COMMAND} --log x").exit_code == 127  # other profiles: the exact command only
