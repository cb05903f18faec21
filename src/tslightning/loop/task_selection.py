"""The tasks a run trains on: ``rollout.tasks`` (or the shipped library) narrowed to ``rollout.task_names`` and to
``rollout.split``'s side of the group split (App. C.2), each task checked for what ``fit`` can train on.

Used by ``fit``'s preflight (every problem named before anything is written) and by ``tslightning validate`` (the
same loading and split rule on the evaluation side).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tslightning.loop.settings import RolloutSettings, settings_error
from tslightning.tasks.environment.helper_services import helper_images
from tslightning.tasks.environment.image_lite import ImageBuildError, build_image
from tslightning.tasks.simulated_tool import simulated_tasks
from tslightning.tasks.split import split_of
from tslightning.tasks.terminal_task import TaskFormatError, TerminalTask, find_task_dirs
from tslightning.tasks.validation import library_dir, unmet_needs


@dataclass
class TaskSelection:
    """The training tasks ``rollout`` selects, and what is wrong with the selection (each line names the key)."""

    tasks: list
    problems: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    """Problems that are a path that does not exist."""


def training_tasks(rollout: RolloutSettings) -> list:
    """The training tasks of ``rollout``; raises :class:`~tslightning.loop.settings.SettingsError` (a ``ValueError``
    or ``FileNotFoundError``) naming every problem."""
    selection = select_tasks(rollout)
    error = settings_error(selection.problems, selection.missing)
    if error is not None:
        raise error
    return selection.tasks


def select_tasks(rollout: RolloutSettings) -> TaskSelection:
    """Load ``rollout``'s tasks (only the named ones when ``task_names`` is given) and keep its split's side."""
    if rollout.environment == "simulated_tool":
        return _simulated_tasks(rollout)
    root = Path(rollout.tasks) if rollout.tasks else library_dir()
    if not root.is_dir():
        fix = "give a task directory or a directory of tasks (null: the shipped library)"
        return TaskSelection([], missing=[f"rollout.tasks {root} is not a directory; {fix}"])
    selection = TaskSelection([])
    for directory in _named_directories(root, rollout.task_names, selection.problems):
        task, problem = _trainable_task(directory)
        if problem is None:
            selection.tasks.append(task)
        else:
            selection.problems.append(problem)
    if rollout.split != "all" and 0 <= rollout.dev_fraction <= 1:  # out of range: RolloutSettings.problems says so
        selection.tasks = [t for t in selection.tasks if split_of(t.group_id, rollout.dev_fraction) == rollout.split]
    if not selection.tasks and not selection.problems:
        selection.problems.append(
            f"rollout.split={rollout.split!r} leaves no tasks in {root}; use split: all or more tasks"
        )
    return selection


def _named_directories(root: Path, names: list[str] | None, problems: list[str]) -> list[Path]:
    """The task directories under ``root`` (only ``names``, when given); an empty root or unknown names go to
    ``problems``."""
    directories = find_task_dirs(root)
    if not directories:
        problems.append(f"rollout.tasks {root} holds no task (a directory with task.toml); point it at one")
    if names is None:
        return directories
    known = [d.name for d in directories]
    unknown = sorted(set(names) - set(known))
    if unknown and directories:
        problems.append(f"rollout.task_names {unknown} are not tasks in {root} (it has {_few(known)})")
    return [d for d in directories if d.name in names]


def _trainable_task(directory: Path) -> tuple[TerminalTask | None, str | None]:
    """The task in ``directory``, or the one-line reason ``fit`` cannot train on it (naming the fix)."""
    try:
        task = TerminalTask.load(directory)
    except TaskFormatError as error:
        return None, (
            f"rollout.tasks: task {directory.name!r} ({directory}) is not a valid Harbor task: "
            f"{'; '.join(error.problems)} (fix it, or leave it out with rollout.task_names)"
        )
    if task.multi_step:
        return None, (
            f"rollout.tasks: task {task.name!r} is a multi-step task ([[steps]]), which fit does not train on "
            "(a step's instruction would arrive mid-trajectory); `tslightning tasks validate` runs it. Leave it "
            "out with rollout.task_names"
        )
    unmet = unmet_needs(task)
    if unmet is not None:
        return None, (
            f"rollout.tasks: task {task.name!r} {unmet[0]}: {'; '.join(unmet[1])} (leave it out with "
            "rollout.task_names; `tslightning tasks validate` lists what each task needs)"
        )
    return task, _build_image(task)


def _build_image(task: TerminalTask) -> str | None:
    """Build (or find in the cache) the image-lite environment of a task that needs one (and its helper services'),
    before any rollout."""
    if task.needs.status != "build":
        return None
    try:
        build_image(task.dockerfile, timeout_s=task.environment.build_timeout_sec)
        helper_images(task)
    except ImageBuildError as error:
        return f"rollout.tasks: task {task.name!r}: its image did not build: environment/{error}"
    return None


def _simulated_tasks(rollout: RolloutSettings) -> TaskSelection:
    tasks = simulated_tasks(rollout.simulated_tool)
    if rollout.task_names is None:
        return TaskSelection(tasks)
    unknown = sorted(set(rollout.task_names) - {t.task_id for t in tasks})
    if unknown:
        return TaskSelection([], [f"rollout.task_names {unknown} are not simulated_tool tasks (gauge-0 ...)"])
    return TaskSelection([t for t in tasks if t.task_id in rollout.task_names])


def _few(names: list[str], shown: int = 6) -> str:
    return ", ".join(names[:shown]) + (f", ... ({len(names)} in all)" if len(names) > shown else "")
