"""Environment set-up and close run on threads off the agent loop, in parallel, and never leave an environment open."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

import pytest
from fakes import RecordingAttempt, ScriptedEngine

from tslightning.rollout.environment_setup import MAX_SETUP_THREADS, EnvironmentSetup, setup_threads
from tslightning.rollout.rollout_datamodule import RolloutDataModule


@dataclass(frozen=True)
class Task:
    task_id: str
    instruction: str


TASKS = [Task(f"task-{i}", f"Create file number {i} in /app") for i in range(3)]
REPLIES = {0: ["<bash>ls</bash>", "<finish/>"], 1: ["<finish/>"], 2: ["<bash>cat x</bash>", "<finish/>"]}


class Environments:
    """An attempt factory whose first set-up (or close) waits for ``release``; it records threads and what is open."""

    def __init__(self, hold: str = "") -> None:
        self.hold = hold
        """``"open"`` or ``"close"``: the first environment's set-up or close waits for :attr:`release`."""
        self.entered, self.release = threading.Event(), threading.Event()
        self.released_in_time: bool | None = None
        self.opened: list[RecordingAttempt] = []
        self.closed: list[RecordingAttempt] = []
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def _maybe_hold(self, stage: str) -> None:
        with self._lock:
            first = self.hold == stage and not self.entered.is_set()
            if first:
                self.entered.set()
        if first:
            self.released_in_time = self.release.wait(timeout=10)

    @contextlib.contextmanager
    def __call__(self, task):
        self.threads.add(threading.current_thread().name)
        self._maybe_hold("open")
        attempt = RecordingAttempt()
        with self._lock:
            self.opened.append(attempt)
        try:
            yield attempt
        finally:
            self.threads.add(threading.current_thread().name)
            self._maybe_hold("close")
            with self._lock:
                self.closed.append(attempt)
            if len(self.closed) == 5:  # every attempt but the held one is done
                self.release.set()

    @property
    def open_now(self) -> list[RecordingAttempt]:
        return [attempt for attempt in self.opened if attempt not in self.closed]


@pytest.mark.parametrize("hold", ["open", "close"])
def test_a_slow_set_up_or_close_holds_up_no_other_attempt(tokenizer, hold):
    """One attempt's set-up (or close) waits until the 5 others have run and closed: on the agent loop's thread it
    would stall them all, and only the time-out would end the wait."""
    environments = Environments(hold=hold)
    dm = RolloutDataModule(
        ScriptedEngine(tokenizer, REPLIES), tokenizer, TASKS, environments, prompts_per_update=2,
        samples_per_prompt=3, run_seed=1, max_concurrent_attempts=6,
    )  # fmt: skip
    try:
        items = list(dm.stream_update(0))
    finally:
        dm.teardown("fit")
    assert environments.released_in_time is True and len(items) > 6
    assert environments.threads <= {f"tslightning-setup_{i}" for i in range(setup_threads(None))}
    assert len(environments.opened) == 6 and environments.open_now == []


def test_an_attempt_cancelled_during_its_set_up_closes_the_environment_once_open():
    environments = Environments(hold="open")
    setup = EnvironmentSetup(environments)

    async def cancel_while_opening() -> None:
        opening = asyncio.create_task(setup.open(TASKS[0]))
        assert await asyncio.to_thread(environments.entered.wait, 10)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    asyncio.run(cancel_while_opening())
    environments.release.set()
    setup.shutdown()  # the set-up finishes, then its environment is closed
    assert len(environments.opened) == 1 and environments.open_now == []


def test_a_close_completes_though_its_attempt_is_cancelled():
    environments = Environments(hold="close")
    setup = EnvironmentSetup(environments)

    async def cancel_while_closing() -> None:
        prepared = await setup.open(TASKS[0])
        closing = asyncio.create_task(setup.close(prepared))
        assert await asyncio.to_thread(environments.entered.wait, 10)
        closing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closing

    asyncio.run(cancel_while_closing())
    environments.release.set()
    setup.shutdown()
    assert len(environments.closed) == 1 and environments.open_now == []


def test_a_failed_set_up_reaches_its_attempt_and_leaves_nothing_open():
    def failing(task):
        raise RuntimeError(f"environment of {task.task_id} did not start")

    setup = EnvironmentSetup(failing)
    with pytest.raises(RuntimeError, match="task-0 did not start"):
        asyncio.run(setup.open(TASKS[0]))
    setup.shutdown()


def test_set_up_threads_follow_the_rollouts_cores_within_bounds():
    assert setup_threads([0]) == 2 and setup_threads([0, 1, 2]) == 3
    assert setup_threads(list(range(64))) == MAX_SETUP_THREADS
