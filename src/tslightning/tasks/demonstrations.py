"""Demonstrations: a task solved as agent turns, for the supervised warm start (:mod:`tslightning.loop.warm_start`).

Each shipped task's reference solution becomes a two-turn transcript (run it, then finish), and optionally a
near miss — the same command slightly wrong — so that sampled groups carry a reward spread to learn from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Demonstration:
    """One task solved by the agent: the instruction, then (action text, observation text) per turn.

    The last turn's observation is ignored (typically the ``<finish/>`` turn).
    """

    instruction: str
    turns: tuple[tuple[str, str], ...]


def reference_demonstration(task) -> Demonstration:
    """A task's reference solution (``solution/solve.sh``) as a two-turn demonstration: run it, then finish.

    Shebang, comments, ``set -e...`` and ``cd /app`` lines are dropped (the agent's shell already starts in /app).
    """
    script = task.solution_script
    if script is None:
        raise ValueError(f"task {task.name!r} has no solution/solve.sh to demonstrate")
    kept = [
        line
        for line in script.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith(("#", "set -", "cd /app"))
    ]
    return Demonstration(
        task.instruction.strip(), ((f"<bash>{chr(10).join(kept)}</bash>", "[exit code 0]"), ("<finish/>", ""))
    )


def task_demonstrations(tasks, near_misses: bool) -> list[Demonstration]:
    """Each task's reference solution as a demonstration, plus (``near_misses``) a partially right variant of it."""
    demos = [reference_demonstration(t) for t in tasks if t.solution_script is not None]
    if near_misses:
        demos += [near_miss(d) for d in demos]
    return demos


def near_miss(demo: Demonstration) -> Demonstration:
    """The reference command with its last line dropped (or, for one-liners, with no output redirection): usually
    partially right, so its verifier scores between the no-op's and the reference's."""
    action = demo.turns[0][0].removeprefix("<bash>").removesuffix("</bash>")
    lines = action.splitlines()
    wrong = "\n".join(lines[:-1]) if len(lines) > 1 else action.split(">")[0].strip()
    return Demonstration(demo.instruction, ((f"<bash>{wrong}</bash>", "[exit code 0]"), ("<finish/>", "")))
