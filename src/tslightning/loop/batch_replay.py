"""Replaying recorded batches: ``fit --replay_batches DIR`` trains on what ``fit --record_batches true`` saved.

Each learner rank ingests, for each update k, exactly the items it recorded in ``DIR/rank<r>-update<k>.pt``
(:mod:`tslightning.loop.batch_recording`), in the recorded order, instead of rolling out; the rest of ``fit`` —
strategy, optimizer, clipping, barrier, checkpoints, resume, logging — is unchanged. Re-running the learner on
recorded batches checks determinism (a killed and resumed run against the uninterrupted replay, bitwise), compares
strategies or precisions on the same data, or reproduces a divergence without the rollout.

No rollout engine and no OPD teacher is started: the recorded items are the rollout. Nothing serves the policy, so
``fit`` installs no :class:`~tslightning.callbacks.WeightPublisher` and says so when the replay starts: θ_{k+1} is
published to no replica (``timing_s/update_weights`` is 0; MFU and checkpoints count no publication). The rollout
metrics come from the recorded sources (:meth:`RecordedBatches.outcome`): ``train/mean_reward`` is the mean reward of
this update's recorded GRPO trajectories over every rank; OPD turn sources hold neither a reward nor the sampled
log-probs, so an OPD replay logs no reward (``NaN`` in ``rewards.json``) and no teacher gap. Environment metrics
(``rollout/environment_wait_s``, ...) are not logged: no environment is opened; the release trace holds the
learner's service intervals without ready times (nothing became ready).

A recording replays when (:func:`replay_problems`, before anything is written): it holds a file for every rank and
every update ``0 … updates−1``, recorded on this run's world size, with this run's objective and GRPO group layout
(``learner.shard_statistics``), and each update's items carry the policy version the replay reaches there — update k
at θ_k, the zero-staleness schedules' batches (``sync``, ``thundersync``); a ``fully_async`` recording, whose
batches mix versions, is refused, as is replaying under ``async``/``fully_async`` (continuous, no per-update
batches) or recording into the directory being replayed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import BatchClosed, StreamItem, TrajectorySource
from tslightning.distributed.learner_strategy import LearnerSettings
from tslightning.loop.batch_recording import batch_file, read_batch
from tslightning.loop.updates import RolloutOutcome

_BATCH_FILE = re.compile(r"rank(\d+)-update(\d+)\.pt")


class RecordedBatches:
    """This learner rank's recorded batches, streamed update by update in place of the rollout DataModule.

    Args:
        directory: ``fit --record_batches``' ``<out_dir>/batches``, checked by :func:`replay_problems`.
        rank: This rank's global rank: it replays ``rank<rank>-update<k>.pt``.
    """

    def __init__(self, directory: Path, rank: int) -> None:
        self.directory = Path(directory)
        self.rank = rank
        self._items: dict[int, list[BatchPlan | StreamItem]] = {}

    def stream_update(self, update: int) -> Iterator[BatchPlan | StreamItem]:
        """Update ``update``'s recorded items in the recorded order: its plan, sources, events, ``BatchClosed``."""
        items = read_batch(batch_file(self.directory, self.rank, update))
        self._items[update] = items
        yield from items

    def outcome(self, update: int) -> RolloutOutcome:
        """The rewards of update ``update``'s recorded GRPO trajectories (an OPD batch records none)."""
        items = self._items.pop(update)
        rewards = [item.reward for item in items if isinstance(item, TrajectorySource)]
        return RolloutOutcome(rewards, rewards_known=items[0].objective is Objective.GRPO)


def replay_problems(
    replay_batches: str | None,
    *,
    updates: int,
    objective: str,
    schedule: str,
    learner: LearnerSettings,
    out_dir: str,
    record_batches: bool,
    overwrite: bool,
) -> tuple[list[str], list[str]]:
    """Why ``replay_batches`` cannot be replayed by this run: ``(problems, missing paths)``, one line each naming the
    setting and the fix (both empty: it can, or there is no replay). Reads every recorded file."""
    if replay_batches is None:
        return [], []
    directory = Path(replay_batches)
    problems = _setting_problems(directory, schedule, Path(out_dir), record_batches, overwrite)
    if not directory.is_dir():
        return problems, [f"replay_batches {directory} is not a directory; give a run's <out_dir>/batches"]
    recorded = {(int(m[1]), int(m[2])) for p in directory.iterdir() if (m := _BATCH_FILE.fullmatch(p.name))}
    if not recorded:
        return [
            *problems,
            f"replay_batches {directory} holds no rank<r>-update<k>.pt: record a run with record_batches",
        ], []
    ranks = max(rank for rank, _ in recorded) + 1
    if ranks != learner.world_size:
        return [*problems, _world_size_problem(directory, ranks, learner.world_size)], []
    absent = [(r, k) for k in range(updates) for r in range(ranks) if (r, k) not in recorded]
    if absent:
        return [*problems, _missing_files_problem(directory, absent, updates)], []
    if objective not in tuple(Objective):
        return problems, []  # reported with the other settings
    spread = learner.shard_statistics and objective == "grpo" and learner.world_size > 1
    found = [_file_problem(directory, r, k, Objective(objective), spread) for k in range(updates) for r in range(ranks)]
    found = [problem for problem in found if problem is not None]
    if found:
        more = f" (and {len(found) - 1} more file(s) like it)" if len(found) > 1 else ""
        problems.append(found[0] + more)
    return problems, []


def _setting_problems(directory: Path, schedule: str, out: Path, record_batches: bool, overwrite: bool) -> list[str]:
    problems = []
    if schedule in ("async", "fully_async"):
        problems.append(
            f"replay_batches replays one recorded logical batch per update at θ_k; schedule {schedule} samples "
            "continuously or one step off (no per-update batch to replay): set schedule sync or thundersync"
        )
    inside_outputs = _within(directory, out / "batches")
    if record_batches and inside_outputs:
        problems.append(
            f"replay_batches {directory} is where record_batches would write this run's batches (out_dir/batches): "
            "set record_batches false, or give another out_dir"
        )
    elif overwrite and inside_outputs:
        problems.append(
            f"replay_batches {directory} is inside out_dir's batches, which overwrite removes before the run: "
            "give another out_dir"
        )
    return problems


def _within(path: Path, directory: Path) -> bool:
    path, directory = path.resolve(), directory.resolve()
    return path == directory or directory in path.parents


def _world_size_problem(directory: Path, ranks: int, world_size: int) -> str:
    return (
        f"replay_batches {directory} was recorded on {ranks} learner rank(s) and this run has {world_size} "
        f"(learner.devices × learner.num_nodes): each rank replays its own recorded items; set them to {ranks} ranks"
    )


def _missing_files_problem(directory: Path, absent: list[tuple[int, int]], updates: int) -> str:
    complete = min(k for _, k in absent)
    names = ", ".join(batch_file(directory, r, k).name for r, k in absent[:3])
    more = f" and {len(absent) - 3} more" if len(absent) > 3 else ""
    fix = f"set updates to at most {complete}" if complete > 0 else "record this run's updates first"
    return (
        f"replay_batches {directory} lacks {names}{more} of the {updates} update(s) this run replays "
        f"(updates); {fix}, or replay a recording of every update"
    )


def _file_problem(directory: Path, rank: int, update: int, objective: Objective, spread: bool) -> str | None:
    """What keeps rank ``rank``'s recorded update ``update`` from being replayed as update ``update`` at θ_update."""
    path = batch_file(directory, rank, update)
    try:
        items = read_batch(path)
    except Exception as error:  # a file a killed run left half-written, or not a recording
        reason = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        return f"replay_batches: {path} cannot be read ({reason}); record the update again"
    if not (isinstance(items, list) and items and isinstance(items[0], BatchPlan)):
        return f"replay_batches: {path} is not a recorded batch (a list starting with its BatchPlan); record it again"
    plan = items[0]
    if not isinstance(items[-1], BatchClosed):
        return f"replay_batches: {path} ends before its BatchClosed (the run died mid-update); record it again"
    if plan.objective is not objective:
        return f"replay_batches: {path} was recorded with objective {plan.objective.value}: set objective to it"
    if plan.oldest_policy_version is not None:
        return (
            f"replay_batches: {path} was recorded under schedule fully_async, whose batches mix policy versions "
            "and cannot be replayed at θ_k; replay a sync or thundersync recording"
        )
    if objective is Objective.GRPO and (plan.trajectories is not None) != spread:
        recorded = "with" if plan.trajectories is not None else "without"
        return f"replay_batches: {path} deals GRPO groups as a run {recorded} learner.shard_statistics: set it likewise"
    versions = sorted({item.policy_version for item in items if hasattr(item, "policy_version")})
    if versions != [update]:
        return (
            f"replay_batches: {path} holds items of policy version(s) {versions}, but the replay reaches update "
            f"{update} at θ_{update} (zero staleness: each update is differentiated at the version that sampled it); "
            "replay a recording of a sync or thundersync run from its first update"
        )
    return None
