"""Simulated-tool tasks: the benchmark's controlled agent environment (App. B/F workloads on CPU).

Each task asks the agent to read a gauge an exact number of times and then finish. Generation is real (the rollout
engine samples every action); the tool is simulated: a call sleeps for a seeded, heavy-tailed latency — the time a
remote sandbox or API would take, spent without using a CPU core — and returns a reading of seeded length. So a
benchmark controls the two things that shape the release trace: tool latency (its scale sets the rollout/learner
ratio r) and trajectory heterogeneity (tasks need 1..``max_calls`` calls; latencies and observation lengths vary),
while rollout and learner CPU work stay real.

Latencies and readings are a pure function of (seed, task, attempt ordinal, call index): attempts of one task are
numbered in the order the rollout DataModule opens them, which is the same under every schedule when
``max_concurrent_attempts`` admits the whole batch at once; with fewer slots, attempts open as earlier ones finish,
an order that timing can perturb between schedules.

The reward (SETA form, App. C.1) scores how close the number of calls came to the task's target:
p = max(0, 1 − |calls − target| / target), r = p + 0.5·1[p = 1].

Arrival profiles shape the rollout's tail: ``long_tail`` makes some attempts' tool calls slow; ``long_decode`` makes
some tasks' *generation* long — they ask the agent to log every read with a note quoted from the instruction, so
their trajectories generate about 2.5 times the tokens (tool latencies unchanged) and the last trajectories of an
update decode nearly alone. The note is text already in the context, as copied file contents and paths are in real
agent work: what a model-free drafter (:mod:`tslightning.rollout.speculative`) proposes.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from tslightning.tasks.demonstrations import Demonstration

GAUGE_COMMAND = "read-gauge"


@dataclass
class SimulatedToolSettings:
    """The simulated environment of a benchmark workload.

    A call's latency is log-normal, ``median_latency_s · exp(attempt_latency_sigma · z_a + latency_sigma · z_c)``
    with z_a drawn once per attempt (a slow or fast environment) and z_c per call, both standard normal, capped at
    ``max_latency_s``; multiply ``median_latency_s`` to sweep the rollout/learner ratio. The reward check (a test
    suite's run, App. C.1) takes ``verify_median_latency_s · exp(verify_latency_sigma · z_v)``, capped at
    ``max_verify_latency_s``: a GRPO trajectory's learner work waits for it, whatever the trajectory's length.
    """

    num_tasks: int = 8
    """Distinct gauge tasks (task ``gauge-<i>`` needs ``1 + i mod max_calls`` calls)."""
    max_calls: int = 4
    """Largest number of gauge reads a task asks for."""
    median_latency_s: float = 0.2
    """Median seconds one tool call takes."""
    latency_sigma: float = 0.6
    """Per-call log-normal shape: 0 gives every call the median latency; 1 gives a heavy tail."""
    attempt_latency_sigma: float = 0.0
    """Per-attempt log-normal shape: spreads whole trajectories' durations (and so their ready times)."""
    max_latency_s: float = 5.0
    """Cap on one call's latency (the tool timeout)."""
    arrival: Literal["waves", "long_tail", "long_decode"] = "waves"
    """``waves``: every attempt's latencies from the log-normals above (with ``max_concurrent_attempts`` below the
    batch, trajectories become ready in waves); ``long_tail``: besides, a seeded ``tail_fraction`` of attempts are
    stragglers whose calls all take ``tail_latency_factor`` times as long (their cap too) — the characterization
    [QHH+26] cites, where the slowest 10% of trajectories take about half of the rollout time; ``long_decode``: a
    seeded ``tail_fraction`` of the tasks (at least one) log every read with a ``log_note_chars``-character note
    their instruction quotes, so their trajectories *generate* about 2.5 times the tokens of the same task without
    it (latencies unchanged): a decode-bound tail."""
    tail_fraction: float = 0.1
    """``long_tail``: share of attempts that are stragglers; ``long_decode``: share of tasks that log; in [0, 1]."""
    log_note_chars: int = 72
    """``long_decode``: characters of the note a logging task's every read carries (``read-gauge --log "<note>"``);
    72 makes a logging trajectory about 2.5 times as many tokens as the plain one with the embedded tokenizer."""
    tail_latency_factor: float = 2.5
    """``long_tail``: how many times longer a straggler's calls take (≥ 1). With the balanced bench workload's
    latencies (B = 32 attempts of 1-4 calls, ``attempt_latency_sigma`` 0), 2.5 puts the 90th-percentile attempt's
    tool time at 0.49 of the slowest one's on average (tests/tasks/test_simulated_tool.py)."""
    verify_median_latency_s: float = 0.0
    """Median seconds the reward check takes after the last turn (0: the reward is immediate)."""
    verify_latency_sigma: float = 1.0
    """Log-normal shape of the reward check's latency (independent of the trajectory's length)."""
    max_verify_latency_s: float = 30.0
    """Cap on the reward check's latency (its timeout)."""
    manual_chars: int = 0
    """Length of a gauge manual opening every task's instruction (characters; 0: none) — the long tool documentation
    agent harnesses carry in every prompt: learner work every trajectory recomputes, while the rollout replica
    reuses its prefill across turns (prefix cache)."""
    min_reading_chars: int = 8
    """Shortest gauge reading returned (characters)."""
    max_reading_chars: int = 96
    """Longest gauge reading returned (characters): observation lengths vary between the two."""
    seed: int = 0
    """Seed of latencies and readings."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("num_tasks", "max_calls", "min_reading_chars", "log_note_chars"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1; got {getattr(self, name)}")
        latencies = ("median_latency_s", "latency_sigma", "attempt_latency_sigma", "verify_median_latency_s")
        for name in (*latencies, "verify_latency_sigma"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0; got {getattr(self, name)}")
        if self.max_verify_latency_s < self.verify_median_latency_s:
            problems.append(f"max_verify_latency_s ({self.max_verify_latency_s}) must be >= verify_median_latency_s")
        if self.max_latency_s < self.median_latency_s:
            problems.append(f"max_latency_s ({self.max_latency_s}) must be >= median_latency_s")
        if self.max_reading_chars < self.min_reading_chars:
            problems.append("max_reading_chars must be >= min_reading_chars")
        if not 0.0 <= self.tail_fraction <= 1.0 or self.tail_latency_factor < 1.0:
            problems.append(
                f"tail_fraction must be in [0, 1] and tail_latency_factor >= 1; got {self.tail_fraction}, "
                f"{self.tail_latency_factor}"
            )
        if problems:
            raise ValueError("rollout.simulated_tool: " + "; ".join(problems))


@dataclass(frozen=True)
class SimulatedToolTask:
    """One gauge task: read the gauge ``target_calls`` times (each read logged with ``log_note`` when there is one),
    then finish."""

    task_id: str
    target_calls: int
    manual: str = ""
    log_note: str = ""

    @property
    def name(self) -> str:
        return self.task_id

    @property
    def group_id(self) -> str:
        return self.task_id

    @property
    def read_command(self) -> str:
        """The command of one read: ``read-gauge``, or with the task's log note."""
        return f'{GAUGE_COMMAND} --log "{self.log_note}"' if self.log_note else GAUGE_COMMAND

    @property
    def instruction(self) -> str:
        times = "once" if self.target_calls == 1 else f"{self.target_calls} times"
        task = f"Read the gauge {times} with {GAUGE_COMMAND}, then finish."
        if self.log_note:
            task = f"Read the gauge {times}, logging each read: {self.read_command}. Then finish."
        return f"{self.manual}\n\n{task}" if self.manual else task

    def counts_as_read(self, command: str) -> bool:
        """Whether ``command`` is a gauge read: ``read-gauge`` itself, or (a logging task) with arguments — how
        faithfully the note was copied does not change the reward."""
        words = command.split()
        return command.strip() == GAUGE_COMMAND or (bool(self.log_note) and words[:1] == [GAUGE_COMMAND])


@dataclass(frozen=True)
class GaugeOutcome:
    """What one simulated tool call returns (the agent loop's ``CommandOutcome``)."""

    output: str
    exit_code: int | None
    timed_out: bool = False
    limit_hit: str | None = None


def simulated_tasks(settings: SimulatedToolSettings) -> list[SimulatedToolTask]:
    """The ``num_tasks`` gauge tasks; task i needs ``1 + i mod max_calls`` calls (``long_decode``: the seeded logging
    tasks log each read)."""
    manual, note = gauge_manual(settings.manual_chars), gauge_manual(settings.log_note_chars)
    logging = logging_tasks(settings)
    return [
        SimulatedToolTask(f"gauge-{i}", 1 + i % settings.max_calls, manual, note if i in logging else "")
        for i in range(settings.num_tasks)
    ]


def logging_tasks(settings: SimulatedToolSettings) -> set[int]:
    """``long_decode``: the indices of the tasks that log every read, a seeded ``tail_fraction`` of them (at least
    one); other profiles: none."""
    if settings.arrival != "long_decode":
        return set()
    count = max(1, round(settings.tail_fraction * settings.num_tasks))
    return set(random.Random(f"long_decode/{settings.seed}").sample(range(settings.num_tasks), count))


def gauge_manual(chars: int) -> str:
    """A gauge manual of exactly ``chars`` characters (its sentences repeated, then cut), the same for every task."""
    sentences = (
        f"The {GAUGE_COMMAND} command prints the current reading of the pressure gauge as a line of digits. "
        "Each call takes a fresh reading; readings differ between calls and between gauges. "
        "Run exactly as many reads as the task asks for, one command per turn, and finish when done. "
        "Extra reads or missing reads lower the score; other commands are not available in this environment. "
    )
    return (sentences * (chars // len(sentences) + 1))[:chars]


def gauge_reward(calls: int, target: int) -> float:
    """SETA reward of ``calls`` gauge reads against ``target``: p + 0.5·1[p = 1] with
    p = max(0, 1 − |calls − target| / target)."""
    progress = max(0.0, 1.0 - abs(calls - target) / target)
    return progress + (0.5 if progress == 1.0 else 0.0)


def gauge_reading(ordinal: int, rng: random.Random, settings: SimulatedToolSettings) -> str:
    """The ``ordinal``-th gauge reading (1-based): digits of a seeded length in [min, max]_reading_chars."""
    length = rng.randint(settings.min_reading_chars, settings.max_reading_chars)
    digits = "".join(rng.choice("0123456789") for _ in range(length))
    return f"gauge reading {ordinal}: {digits}"


def gauge_demonstrations(
    tasks: list[SimulatedToolTask], settings: SimulatedToolSettings, near_misses: bool = True
) -> list[Demonstration]:
    """Warm-start demonstrations: each task solved exactly, plus (``near_misses``) one call short and one too many,
    so sampled groups carry a reward spread. Readings have the lengths the tool returns (seeded apart from the
    attempts' readings), so the policy sees in training the observations it will see in rollouts."""
    rng = random.Random(f"demonstrations/{settings.seed}")
    demos = []
    for task in tasks:
        counts = [task.target_calls]
        if near_misses:
            counts += [c for c in (task.target_calls - 1, task.target_calls + 1) if c >= 1]
        for count in counts:
            turns = [
                (f"<bash>{task.read_command}</bash>", f"{gauge_reading(k + 1, rng, settings)}\n[exit code 0]")
                for k in range(count)
            ]
            demos.append(Demonstration(task.instruction, (*turns, ("<finish/>", "")), count == task.target_calls))
    return demos


class SimulatedToolAttempt:
    """One attempt: gauge reads sleep a seeded latency; :meth:`verify` scores the number of reads."""

    def __init__(self, task: SimulatedToolTask, settings: SimulatedToolSettings, ordinal: int) -> None:
        self.task = task
        self.settings = settings
        self.ordinal = ordinal
        self.calls = 0
        """Successful gauge reads so far."""
        self.commands = 0
        """Commands run so far (the call index that seeds each latency)."""
        self.tool_seconds = 0.0
        self.straggler = settings.arrival == "long_tail" and self._rng("tail").random() < settings.tail_fraction
        """Whether this attempt is one of a ``long_tail`` workload's stragglers."""
        self.tail_factor = settings.tail_latency_factor if self.straggler else 1.0
        self.latency_scale = math.exp(settings.attempt_latency_sigma * self._rng(-1).gauss(0.0, 1.0))
        """This attempt's latency multiplier exp(attempt_latency_sigma · z_a)."""

    def run_command(self, command: str) -> GaugeOutcome:
        """Sleep the call's latency; a gauge read returns a reading, any other command fails with exit code 127."""
        latency = self.call_latency(self.commands)
        rng = self._rng(self.commands)
        rng.gauss(0.0, 1.0)  # the draw call_latency made: the reading comes after it
        self.commands += 1
        time.sleep(latency)
        self.tool_seconds += latency
        if not self.task.counts_as_read(command):
            return GaugeOutcome(f"sh: {command.strip()[:40]}: command not found", 127)
        self.calls += 1
        return GaugeOutcome(gauge_reading(self.calls, rng, self.settings), 0)

    def verify(self) -> float:
        """The SETA reward of the reads made, after the reward check's seeded latency (slept, no CPU)."""
        s = self.settings
        if s.verify_median_latency_s > 0:
            z = self._rng("verify").gauss(0.0, 1.0)
            latency = min(s.max_verify_latency_s, s.verify_median_latency_s * math.exp(s.verify_latency_sigma * z))
            time.sleep(latency)
            self.tool_seconds += latency
        return gauge_reward(self.calls, self.task.target_calls)

    def close(self) -> None:
        """Nothing to clean up (no files, no processes)."""

    def __enter__(self) -> SimulatedToolAttempt:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _rng(self, call: int | str) -> random.Random:
        key = f"{self.settings.seed}/{self.task.task_id}/{self.ordinal}/{call}".encode()
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))

    def call_latency(self, call: int) -> float:
        """Seconds the ``call``-th command (0-based) of this attempt takes: a pure function of the seed, the task,
        the attempt ordinal and ``call``."""
        s = self.settings
        scale = self.latency_scale * math.exp(s.latency_sigma * self._rng(call).gauss(0.0, 1.0))
        return self.tail_factor * min(s.max_latency_s, s.median_latency_s * scale)


class SimulatedToolEnvironment:
    """The attempt factory of a simulated-tool workload: numbers each task's attempts in the order they open."""

    def __init__(self, settings: SimulatedToolSettings) -> None:
        self.settings = settings
        self._opened: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()

    def __call__(self, task: SimulatedToolTask) -> SimulatedToolAttempt:
        with self._lock:
            ordinal = self._opened[task.task_id]
            self._opened[task.task_id] += 1
        return SimulatedToolAttempt(task, self.settings, ordinal)
