"""Environment prefetch: update k+1's environments opened ahead, taken by its attempts, the rest always closed; the
rollout's items unchanged (same tasks, seeds, rewards) with prefetch on or off."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from fakes import RecordingAttempt, ScriptedEngine

from tslightning.core.sources import BatchClosed, TrajectorySource
from tslightning.rollout.environment_prefetch import EnvironmentPrefetch, close_prepared
from tslightning.rollout.rollout_datamodule import RolloutDataModule
from tslightning.tasks.environment.image_lite import builder_problem
from tslightning.tasks.task_attempt import TerminalTaskAttempt
from tslightning.tasks.terminal_task import TerminalTask
from tslightning.tasks.validation import library_dir


@dataclass(frozen=True)
class Task:
    task_id: str
    instruction: str


CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "harbor_tasks" / "corpus-workdir"
TASKS = [Task(f"task-{i}", f"Create file number {i} in /app") for i in range(5)]
REPLIES = {0: ["<bash>ls</bash>", "<finish/>"], 1: ["<finish/>"], 2: ["<bash>cat x</bash>", "<finish/>"]}
REWARDS = {task.task_id: reward for task, reward in zip(TASKS, [1.0, 0.0, 0.5, 1.0, 0.25], strict=True)}


class Environments:
    """An attempt factory whose environments record who opened them, on which thread, and whether they closed."""

    def __init__(self, failing: tuple[str, ...] = (), setup_s: float = 0.0) -> None:
        self.failing, self.setup_s = failing, setup_s
        self.opened: list[RecordingAttempt] = []
        self.closed: list[RecordingAttempt] = []
        self.threads: list[str] = []
        self.setting_up = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def __call__(self, task):
        with self._lock:
            self.setting_up += 1
        time.sleep(self.setup_s)
        if task.task_id in self.failing:
            raise RuntimeError(f"environment of {task.task_id} did not start")
        attempt = RecordingAttempt(reward=REWARDS[task.task_id])
        attempt.task_id = task.task_id
        with self._lock:
            self.opened.append(attempt)
            self.threads.append(threading.current_thread().name)
        try:
            yield attempt
        finally:
            with self._lock:
                self.closed.append(attempt)

    @property
    def open_now(self) -> list[RecordingAttempt]:
        return [attempt for attempt in self.opened if attempt not in self.closed]


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the prefetch threads"
        time.sleep(0.01)


def test_prepares_at_most_capacity_in_attempt_order_and_closes_what_is_not_taken():
    environments = Environments()
    prefetch = EnvironmentPrefetch(environments, capacity=3)
    try:
        prefetch.prepare(1, [TASKS[0], TASKS[0], TASKS[1], TASKS[2]])
        _wait_until(lambda: prefetch.prepared == 3)
        assert sorted(a.task_id for a in environments.opened) == ["task-0", "task-0", "task-1"]  # not task-2
        assert set(environments.threads) <= {f"tslightning-prefetch_{i}" for i in range(2)}
        assert prefetch.take(2, TASKS[0]) is None  # another update's attempt gets nothing prepared
        taken = prefetch.take(1, TASKS[0]).result()
        assert taken.attempt.task_id == "task-0" and taken.setup_s >= 0 and prefetch.take(1, TASKS[2]) is None
        prefetch.discard()
        assert len(environments.closed) == 2 and taken.attempt not in environments.closed
        assert prefetch.take(1, TASKS[0]) is None and (prefetch.taken, prefetch.discarded) == (1, 2)
        taken.exit_stack.close()  # the taker closes what it took
        assert environments.open_now == []
    finally:
        prefetch.close()


def test_close_cancels_what_has_not_started_and_closes_what_is_opening():
    environments = Environments(setup_s=0.2)
    prefetch = EnvironmentPrefetch(environments, capacity=6)
    prefetch.prepare(1, TASKS[:4] + TASKS[:2])
    _wait_until(lambda: environments.setting_up == 2)
    prefetch.close()  # while the first two are opening
    assert environments.open_now == [] and len(environments.opened) == 2
    assert prefetch.discarded == 6
    prefetch.prepare(2, TASKS)
    assert prefetch.take(2, TASKS[0]) is None and len(environments.opened) == 2  # closed: it opens no new ones


def test_a_failed_set_up_reaches_the_attempt_that_takes_it_and_nothing_else():
    environments = Environments(failing=("task-1",))
    prefetch = EnvironmentPrefetch(environments, capacity=2)
    try:
        prefetch.prepare(1, TASKS[:2])
        with pytest.raises(RuntimeError, match="task-1 did not start"):
            prefetch.take(1, TASKS[1]).result(timeout=10)
        failed = EnvironmentPrefetch(environments, capacity=1)
        failed.prepare(1, [TASKS[1]])
        failed.close()  # a set-up that failed leaves nothing to close, and closing says nothing about it
    finally:
        prefetch.close()
    assert environments.open_now == []


def test_a_capacity_below_one_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="rollout.prefetch_environments must be >= 1"):
        EnvironmentPrefetch(Environments(), capacity=0)


def test_close_prepared_closes_once_open():
    environments = Environments()
    prefetch = EnvironmentPrefetch(environments, capacity=1)
    try:
        prefetch.prepare(1, [TASKS[3]])
        close_prepared(prefetch.take(1, TASKS[3]))
        assert len(environments.closed) == 1 and environments.open_now == []
    finally:
        prefetch.close()


# ------------------------------------------------------------------ in the rollout DataModule
def _datamodule(tokenizer, environments, prefetch: int, **kwargs) -> RolloutDataModule:
    return RolloutDataModule(
        ScriptedEngine(tokenizer, REPLIES),
        tokenizer,
        TASKS,
        environments,
        prompts_per_update=2,
        samples_per_prompt=3,
        run_seed=1,
        max_concurrent_attempts=2,
        prefetch_environments=prefetch,
        **kwargs,
    )


def _signature(items) -> list:
    """What the learner gets of an update: each source's group, index, tokens, reward and version, in a fixed order."""
    sources = [item for item in items if isinstance(item, TrajectorySource)]
    rows = [(s.group_id, s.trajectory_index, s.token_ids.tolist(), s.reward, s.policy_version) for s in sources]
    return sorted(rows)


def test_the_next_updates_attempts_take_environments_set_up_before_they_began(tokenizer):
    environments = Environments()
    dm = _datamodule(tokenizer, environments, prefetch=4, updates=2)
    try:
        list(dm.stream_update(0))
        assert all(not r.prefetched for r in dm.environment_log)  # nothing before the first update
        _wait_until(lambda: dm.prefetch.prepared == 4)  # the learner's barrier would run now
        list(dm.stream_update(1))
        records = [r for r in dm.environment_log if r.update == 1]
        assert sum(r.prefetched for r in records) == 4 and all(r.ready for r in records if r.prefetched)
        assert (dm.prefetch.taken, dm.prefetch.discarded) == (4, 0)
        assert len(environments.opened) == 12  # 6 + 4 prepared + 2 opened by their attempts
        assert dm.prefetch.prepared == 4  # the last update prepares nothing beyond the run
    finally:
        dm.teardown("fit")
    assert environments.open_now == []


class _HeldCloses(Environments):
    """Once update 0's sixth (last) environment is open, its attempts close only once a seventh (update 1's,
    prepared ahead) is open, or after 5 s; records how many of update 0's were open when it opened."""

    def __init__(self) -> None:
        super().__init__()
        self.next_update_began = threading.Event()
        self.open_when_next_began: int | None = None

    @contextlib.contextmanager
    def __call__(self, task):
        with super().__call__(task) as attempt:
            if len(self.opened) == 7:
                self.open_when_next_began = len(self.open_now) - 1
                self.next_update_began.set()
            yield attempt
            if len(self.opened) >= 6:
                self.next_update_began.wait(5)


def test_the_next_updates_set_up_starts_once_this_updates_environments_are_open(tokenizer):
    """The set-up threads turn to update 1 as soon as update 0's last attempt has its environment: update 1's first
    environment opens while update 0's attempts still run (their turns, tools and verifiers), not after them."""
    environments = _HeldCloses()
    dm = _datamodule(tokenizer, environments, prefetch=4, updates=2)
    try:
        list(dm.stream_update(0))
        assert environments.next_update_began.is_set()
        assert environments.open_when_next_began >= 1  # update 0's last attempts were still running
    finally:
        dm.teardown("fit")
    assert environments.open_now == []


def test_prefetch_does_not_change_which_tasks_seeds_or_rewards_an_update_gets(tokenizer):
    def run(prefetch: int) -> list:
        dm = _datamodule(tokenizer, Environments(), prefetch=prefetch, updates=3)
        try:
            return [_signature(dm.stream_update(update)) for update in range(3)]
        finally:
            dm.teardown("fit")

    assert run(prefetch=3) == run(prefetch=0)


def test_a_failed_rollout_and_the_runs_end_leave_no_environment_open(tokenizer):
    environments = Environments()
    dm = _datamodule(tokenizer, environments, prefetch=4, updates=3)
    first_group_task = dm.tasks_for_update(1)[0].task_id
    environments.failing = (first_group_task,)  # update 1's first attempt fails at set-up (update 0 never has it)
    dm.max_concurrent_attempts = 1  # the failure comes while a prepared environment is still untaken
    list(dm.stream_update(0))
    with pytest.raises(RuntimeError, match="rollout of update 1 failed"):
        for item in dm.stream_update(1):
            assert not isinstance(item, BatchClosed)
    assert dm.prefetch.discarded >= 1 and len(environments.opened) == 7  # update 1's second group's was opened
    assert environments.open_now == []  # ... and closed by the failed rollout
    dm.teardown("fit")
    assert environments.open_now == [] and len(environments.closed) == len(environments.opened)


def test_a_negative_prefetch_is_reported(tokenizer):
    with pytest.raises(ValueError, match="prefetch_environments must be >= 0"):
        _datamodule(tokenizer, Environments(), prefetch=-1)


# ------------------------------------------------------------------ real attempt environments (bubblewrap)
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _view(attempt: TerminalTaskAttempt) -> str:
    """What an attempt's first command sees: its files and the environment's processes (but the probe's own)."""
    files = "cd /app && find . | sort && md5sum $(find . -type f | sort)"
    return attempt.run_command(f"{files}; ps -eo comm= | grep -vx -e ps -e sort -e bash -e grep | sort").output


def test_a_prepared_environment_is_a_fresh_one_and_closing_leaves_no_process_or_directory():
    task = TerminalTask.load(library_dir() / "count-lines")
    prefetch = EnvironmentPrefetch(lambda t: TerminalTaskAttempt(t), capacity=2)
    try:
        with TerminalTaskAttempt(task) as fresh:  # an attempt of update k, opened the usual way
            fresh.run_command("echo changed >> log.txt; sleep 300 &")
            prefetch.prepare(1, [task, task])
            taken = prefetch.take(1, task).result(timeout=60)
            assert taken.attempt.sandbox.live  # set up (its environment started) before the attempt began
            with taken.exit_stack:
                with TerminalTaskAttempt(task) as other_fresh:
                    assert _view(taken.attempt) == _view(other_fresh)  # nothing of update k's attempt in it
            unused = prefetch._waiting[task.task_id][0].result(timeout=60).attempt
            root, keeper = unused.attempt.root, unused.sandbox._keeper.pid
            assert root.is_dir() and _alive(keeper)
    finally:
        prefetch.close()
    assert not root.exists() and not _alive(keeper)  # the environment no attempt took: removed, its bwrap ended


def test_a_prepared_image_environment_has_its_own_copy_of_the_image_and_scores_as_a_fresh_one(monkeypatch):
    problem = builder_problem()
    if problem is not None:
        pytest.skip(problem)
    monkeypatch.setenv("TSLIGHTNING_CACHE_DIR", str(Path(tempfile.gettempdir()) / "tslightning-test-cache"))
    task = TerminalTask.load(CORPUS)
    prefetch = EnvironmentPrefetch(lambda t: TerminalTaskAttempt(t), capacity=1)
    try:
        with TerminalTaskAttempt(task) as earlier:  # update k's attempt spoils its copy of the working directory
            earlier.run_command("rm -r shards/shard00 && echo 6858 > answer.txt")
            prefetch.prepare(1, [task])
            prepared = prefetch.take(1, task).result(timeout=300)
        with prepared.exit_stack:
            attempt = prepared.attempt
            assert attempt.sandbox.live and attempt.sandbox.starts == 1
            seen = attempt.run_command("pwd; test -e answer.txt && echo answered; find shards -type f | wc -l")
            assert seen.output.split() == ["/srv/corpus", "12000"]  # the image's working directory, untouched
            assert attempt.verify() == 0.0  # no answer of update k's attempt in it
            attempt.run_solution()
            assert attempt.verify() == 1.5
            image_rw = attempt.attempt.root / "image-rw"
        assert not image_rw.exists()
    finally:
        prefetch.close()
