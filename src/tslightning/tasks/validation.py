"""Executable validation of terminal tasks (App. C.2): the reference solution passes, the no-op agent does not.

For each task two fresh attempts are made, each in its own sandbox attempt directory seeded from ``environment/``:
the *no-op* agent runs nothing, the *reference* agent runs ``solution/solve.sh``; the verifier then scores each.
A task is valid when the reference scores a full pass (``p = 1``) and the no-op does not. Failing tasks are removed
from every schedule's cohort (App. C.2); :func:`validate_tasks` reports them with the verifier output's tail.

Each task gets one status: ``valid``; ``invalid`` (a file or key is wrong, or the reference / no-op verdicts are);
or, when its environment cannot be provided here, what it needs (``needs image``, ``needs network at build``,
``needs helper container``, ``needs model API``; see :mod:`~tslightning.tasks.harbor.environment_needs`), with the
reason,
and no attempt is run:
a reference solution is never reported as failing when the environment is the cause. A reference that fails after a
write the read-only root refused (``mkdir /data``: a container's root is writable throughout) is ``needs image``.
Build time (``-`` when the host stands in) and each attempt's set-up time (opening the environment until the agent
could act) are reported, and for a task with helper services each service's start-up seconds (until healthy). An
environment that does not start (an unhealthy helper) makes the task invalid with the reason, not a score.
"""

from __future__ import annotations

import importlib.resources
import re
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from tslightning.sandbox import CommandResult
from tslightning.sandbox.compose import compose_available
from tslightning.sandbox.errors import SandboxError
from tslightning.tasks.environment.helper_services import helper_images
from tslightning.tasks.environment.image_lite import ImageBuildError, ImageLite, build_image, builder_problem
from tslightning.tasks.environment.offline_toolchain import default_cache_dir, fetches_toolchain, find_toolchain
from tslightning.tasks.rewards import (
    DEFAULT_REWARD_KEY,
    EVERY_NAMED_REWARD,
    RewardScheme,
    choose_reward_key,
    max_reward,
)
from tslightning.tasks.task_attempt import SandboxFactory, TerminalTaskAttempt, sandbox_factory
from tslightning.tasks.task_steps import run_steps
from tslightning.tasks.terminal_task import TaskFormatError, TerminalTask, find_task_dirs
from tslightning.tasks.verifier import VerifierResult

__all__ = [
    "SandboxFactory",
    "TaskValidation",
    "format_table",
    "unmet_needs",
    "library_dir",
    "read_only_writes",
    "sandbox_factory",
    "validate_task",
    "validate_tasks",
]


@dataclass(frozen=True)
class TaskValidation:
    """The outcome of validating one task.

    Attributes:
        task: The task's name.
        path: The task directory.
        noop: The verifier's verdict on the untouched environment (``None`` if it never ran).
        reference: The verifier's verdict after ``solution/solve.sh`` (``None`` if it never ran).
        problems: Why the task is invalid or cannot run here; empty when it is valid.
        needs: What the environment needs when it cannot be provided here (``needs image``, ...), else ``None``.
        build_s: Seconds spent building the environment, helper services' images included (``None``: nothing was
            built).
        setup_s: Mean seconds from opening an attempt until its agent could act (``None``: no attempt ran).
        services: Each helper service's mean start-up seconds (until healthy, or started without a healthcheck),
            by name; ``None`` for a task without helpers (or whose attempts did not run).
    """

    task: str
    path: Path
    noop: VerifierResult | None = None
    reference: VerifierResult | None = None
    problems: tuple[str, ...] = field(default_factory=tuple)
    needs: str | None = None
    build_s: float | None = None
    setup_s: float | None = None
    services: dict[str, float] | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def status(self) -> str:
        """``valid``, ``invalid``, or the environment's need (``needs image``, ``needs network at build``,
        ``needs helper container``)."""
        if self.needs is not None:
            return self.needs
        return "valid" if self.ok else "invalid"


def library_dir() -> Path:
    """The shipped task library (``tslightning/tasks/library``), found through ``importlib.resources``."""
    library = importlib.resources.files("tslightning.tasks") / "library"
    if not isinstance(library, Path) or not library.is_dir():
        raise FileNotFoundError(f"the shipped task library is missing or not on the file system: {library}")
    return library


def validate_task(
    task_dir: Path,
    scheme: RewardScheme = "seta",
    make_attempt_sandbox: SandboxFactory | None = None,
    reward_key: str = DEFAULT_REWARD_KEY,
    allow_internet: bool = False,
    containers: bool | str = False,
) -> TaskValidation:
    """Validate one task directory: load it, then score the no-op and the reference, each in a fresh attempt (a
    multi-step task: through all its steps, the reference running each step's solution).

    Args:
        task_dir: The task directory.
        scheme: Reward scheme the verdicts are reported in.
        make_attempt_sandbox: Makes each attempt's sandbox (default: bubblewrap).
        reward_key: The named reward of ``reward.json`` read as the pass fraction; left at ``reward``, a verifier
            that writes only named rewards passes when every one of them is full (``EVERY_NAMED_REWARD``).
        allow_internet: Let a task that allows the internet reach it (see ``TerminalTaskAttempt``).
        containers: The attempts run in a container engine (its name, or True for docker), which builds or pulls
            the images itself and runs helper containers with compose.
    """
    factory = make_attempt_sandbox or sandbox_factory()
    if reward_key == DEFAULT_REWARD_KEY:
        reward_key = EVERY_NAMED_REWARD
    try:
        task = TerminalTask.load(task_dir)
    except TaskFormatError as error:
        return TaskValidation(task=Path(task_dir).name, path=Path(task_dir), problems=tuple(error.problems))
    if task.solution_script is None:
        return TaskValidation(task.name, task.root, problems=("no solution/solve.sh to validate against",))
    unmet = unmet_needs(task, containers)
    if unmet is not None:
        return TaskValidation(task.name, task.root, problems=unmet[1], needs=unmet[0])
    image, services, build_s = None, None, None
    if task.needs.status == "build" and not containers:
        started = time.perf_counter()
        try:
            image = build_image(task.dockerfile, timeout_s=task.environment.build_timeout_sec)
            services = helper_images(task)
        except ImageBuildError as error:
            return TaskValidation(task.name, task.root, problems=(f"environment/{error}",), needs=error.needs)
        built = [image.build_s, *(helper.build_s for helper in services.values())]
        build_s = sum(built) if any(built) else time.perf_counter() - started
    try:
        (noop, noop_setup, noop_services), (reference, reference_setup, reference_services) = (
            _attempt(task, factory, scheme, reward_key, solution, image, allow_internet, services)
            for solution in (False, True)
        )
    except SandboxError as error:  # the environment (a helper service) did not start: why, not a score
        return TaskValidation(task.name, task.root, problems=(f"the environment did not start: {error}",))
    problems = _noop_problems(noop) + _reference_problems(reference, scheme)
    refused = [] if reference.passed else read_only_writes(reference.output, reference.reason)
    if refused:  # the environment, not the task, failed the reference: say so instead of "invalid"
        problems.insert(0, _read_only_problem(refused))
    return TaskValidation(
        task.name,
        task.root,
        noop=noop,
        reference=reference,
        problems=tuple(problems),
        needs="needs image" if refused else None,
        build_s=build_s,
        setup_s=(noop_setup + reference_setup) / 2,
        services=_mean_seconds(noop_services, reference_services),
    )


def _mean_seconds(first: dict[str, float] | None, second: dict[str, float] | None) -> dict[str, float] | None:
    if not first or not second:
        return first or second or None
    return {name: (first[name] + second[name]) / 2 for name in first if name in second}


_READ_ONLY = re.compile(
    r"\[Errno 30\] Read-only file system: '(/[^']*)'"  # Python's OSError
    r"|[‘'](/[^'’]*)[’']: Read-only file system"  # coreutils: cannot create directory '/data' (or ‘/data’)
    r"|(/[^\s:'\"’]+): Read-only file system"  # the shell: script: line 3: /etc/motd: ...
)
READ_ONLY_BY_DESIGN = ("/tests",)
"""Read-only here and writable in Harbor's container, but only for caches (pytest's ``.pytest_cache`` warning)."""


def read_only_writes(*outputs: str) -> list[str]:
    """The paths ``outputs`` show a write refused with ``EROFS`` at (outside :data:`READ_ONLY_BY_DESIGN`): places a
    container's writable root allows and this environment's read-only root does not (``/data`` at the top, ...)."""
    matches = [match for text in outputs for match in _READ_ONLY.finditer(text)]
    paths = [next(group for group in match.groups() if group) for match in matches]
    allowed = [p for p in paths if not any(p == d or p.startswith(f"{d}/") for d in READ_ONLY_BY_DESIGN)]
    return list(dict.fromkeys(allowed))


def _read_only_problem(paths: list[str]) -> str:
    return (
        f"the reference's run wrote to {', '.join(paths)}, read-only here (an attempt writes /app, /tmp and, in a "
        "built image, its own copies of the working directory, /root, /home, /var/tmp and /etc/hosts); a container's "
        "root is writable throughout: it needs its image"
    )


def unmet_needs(task: TerminalTask, containers: bool | str = False) -> tuple[str, tuple[str, ...]] | None:
    """``(status, reasons)`` when ``task``'s environment cannot be provided here, else ``None``.

    A task that needs a build reports ``needs image`` until a builder is available for it (its reasons name what in
    the Dockerfile needs the build); one with helper services, ``needs helper container`` (they run as image-lite
    roots). A verifier that downloads its toolchain (the Terminal-Bench 2 template) needs the network unless the
    offline toolchain is prepared (``tslightning tasks toolchain``). With ``containers`` (the docker and podman
    backends, named, or True for docker) the engine builds or pulls every image, and helper containers run with
    compose where the engine has it (else ``needs helper container``); a helper that calls an outside model API
    needs it either way (attempts run offline).
    """
    needs = task.needs
    if containers:
        return _unmet_with_engine(task, containers)
    fetch = fetches_toolchain(task.tests_dir) if find_toolchain() is None else None
    if needs.status == "host" and fetch is not None:
        reason = (
            f"its tests download their toolchain ({fetch}) and the offline toolchain is not prepared: run "
            f"`tslightning tasks toolchain {task.root.parent}` once (it fills {default_cache_dir()})"
        )
        return "needs network at build", (reason,)
    if needs.status == "host":
        return None
    if needs.status == "build":
        problem = builder_problem()
        if problem is None:
            return None
        if needs.helpers:
            names = ", ".join(service.name for service in needs.helpers)
            return "needs helper container", (f"its helper services ({names}) run as image-lite roots, and {problem}",)
        reasons = tuple(f"needs a build of its image ({r}), and {problem}" for r in needs.reasons)
        return "needs image", reasons
    return needs.status, needs.reasons


def _unmet_with_engine(task: TerminalTask, containers: bool | str) -> tuple[str, tuple[str, ...]] | None:
    needs = task.needs
    separate = any("environment_mode" in reason for reason in needs.reasons)
    if needs.compose is not None and needs.compose.model_apis:
        return "needs model API", needs.compose.model_apis
    if not separate and not needs.helpers:
        return None
    cli = shutil.which(containers if isinstance(containers, str) else "docker")
    if not separate and cli is not None and compose_available(cli):
        return None  # its helper services run with compose
    why = "a verifier in a container of its own is not run" if separate else "`compose` is not available"
    reasons = (*needs.reasons, f"{why} with the {containers} backend; leave the task out")
    return "needs helper container", reasons


def validate_tasks(
    path: str | Path | None = None,
    scheme: RewardScheme = "seta",
    workers: int = 2,
    make_attempt_sandbox: SandboxFactory | None = None,
    reward_key: str = DEFAULT_REWARD_KEY,
    allow_internet: bool = False,
    containers: bool | str = False,
) -> list[TaskValidation]:
    """Validate every task under ``path`` (a task directory or a directory of them; default: the shipped library).

    Tasks run on ``workers`` threads (each sandboxed command is its own process tree); results come back in
    task-name order.
    """
    task_dirs = find_task_dirs(library_dir() if path is None else path)
    if not task_dirs:
        raise FileNotFoundError(f"no task directories (with a task.toml) under {path}")
    factory = make_attempt_sandbox or sandbox_factory()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(
            pool.map(
                lambda task_dir: validate_task(task_dir, scheme, factory, reward_key, allow_internet, containers),
                task_dirs,
            )
        )


def format_table(results: Sequence[TaskValidation]) -> str:
    """A fixed-width table: task, no-op verdict, reference verdict, build and set-up seconds, status; then each
    failure's problems."""
    width = max([len("task"), *(len(result.task) for result in results)])
    header = f"{'task':<{width}}  {'no-op':<16}  {'reference':<16}  {'build s':>7}  {'setup s':>7}  status"
    lines = [header, "-" * (len(header) + 20)]
    for result in results:
        cells = f"{_cell(result.noop):<16}  {_cell(result.reference):<16}"
        times = f"{_seconds(result.build_s):>7}  {_seconds(result.setup_s):>7}"
        status = "FAIL: invalid" if result.status == "invalid" else result.status
        lines.append(f"{result.task:<{width}}  {cells}  {times}  {status}")
    failed = [result for result in results if not result.ok]
    counts = {status: sum(r.status == status for r in results) for status in dict.fromkeys(r.status for r in results)}
    started = [result for result in results if result.services]
    if started:
        lines.append("\nhelper services (start-up s: until healthy, or started without a healthcheck):")
        for result in started:
            seconds = ", ".join(f"{name} {value:.2f}" for name, value in result.services.items())
            lines.append(f"  {result.task}: {seconds}")
    lines.append(f"\n{len(results) - len(failed)}/{len(results)} tasks valid")
    if len(counts) > 1 or "valid" not in counts:
        lines.append("by status: " + ", ".join(f"{status} {count}" for status, count in counts.items()))
    for result in failed:
        lines.append(f"\n{result.task} ({result.path}):")
        lines.extend(f"  - {problem}" for problem in result.problems)
    return "\n".join(lines)


def _attempt(
    task: TerminalTask,
    factory: SandboxFactory,
    scheme: RewardScheme,
    reward_key: str,
    run_solution: bool,
    image: ImageLite | None,
    allow_internet: bool,
    service_images: dict[str, ImageLite] | None = None,
) -> tuple[VerifierResult, float, dict[str, float] | None]:
    """The verdict of one attempt, its set-up seconds, and its helper services' start-up seconds."""
    started = time.perf_counter()
    with TerminalTaskAttempt(
        task,
        scheme,
        factory,
        reward_key=reward_key,
        image=image,
        allow_internet=allow_internet,
        service_images=service_images,
    ) as attempt:
        setup_s = time.perf_counter() - started
        services = dict(attempt.services.startup_s) if attempt.services is not None else None
        if task.multi_step:
            return _steps_attempt(attempt, run_solution), setup_s, services
        solution_note = ""
        if run_solution:
            solved = attempt.run_solution()
            if not solved.ok:
                solution_note = _solution_failure(solved)
        attempt.verify()
        result = attempt.verification
    if solution_note:  # keep the solution's own failure beside the verifier's verdict
        return replace(result, reason=f"{result.reason}; {solution_note}"), setup_s, services
    return result, setup_s, services


def _steps_attempt(attempt: TerminalTaskAttempt, run_solution: bool) -> VerifierResult:
    notes: list[str] = []

    def act(step, instruction: str) -> None:
        if run_solution:
            solved = attempt.run_solution(attempt.task.step_dir(step.name) / "solution", step.agent.timeout_sec)
            if not solved.ok:
                notes.append(f"step {step.name!r}: {_solution_failure(solved)}")

    verdict, _ = run_steps(attempt, act)
    return replace(verdict, reason="; ".join([verdict.reason, *notes]))


def _noop_problems(noop: VerifierResult) -> list[str]:
    if noop.passed:
        return [f"no-op agent already passes ({noop.reason}): the verifier does not check the task's outcome"]
    return []


def _reference_problems(reference: VerifierResult, scheme: RewardScheme) -> list[str]:
    if reference.passed:
        return []
    expected = max_reward(scheme)
    reason = reference.reason
    if reference.reading is not None and reference.reading.key == EVERY_NAMED_REWARD:
        reason += f"; {choose_reward_key(reference.reading.named)} if not every one must be full"
    return [
        f"reference solution scored {reference.reward:g} (expected {expected:g}): {reason}\n"
        f"    verifier output tail:\n{_indent(reference.output_tail(), '      ')}"
    ]


def _solution_failure(result: CommandResult) -> str:
    what = "timed out" if result.timed_out else f"exited {result.exit_code}"
    return f"solution/solve.sh {what}: {result.output[-300:].strip()!r}"


def _cell(result: VerifierResult | None) -> str:
    if result is None:
        return "-"
    if result.passed_fraction is None:
        return "error"
    return f"p={result.passed_fraction:.2f} r={result.reward:.2f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.rstrip().splitlines()) or prefix + "(no output)"
