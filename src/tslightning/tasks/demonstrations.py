"""Demonstrations: a task solved as agent turns, for the supervised warm start (:mod:`tslightning.loop.warm_start`).

Each shipped task's reference solution becomes a two-turn transcript (run it, then finish), and optionally a
near miss — the same command slightly wrong — so that sampled groups carry a reward spread to learn from
(``warm_start.reference_share`` sets how often the warm start shows each kind).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Demonstration:
    """One task solved by the agent: the instruction, then (action text, observation text) per turn.

    The last turn's observation is ignored (typically the ``<finish/>`` turn). ``reference`` is false for a near
    miss (a plausible wrong solution, shown so that sampled groups carry a reward spread).
    """

    instruction: str
    turns: tuple[tuple[str, str], ...]
    reference: bool = True


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
    """The reference command made wrong in a plausible way, so its verifier scores it below the reference: its last
    line dropped; a one-liner's output redirection dropped (prints instead of writing), else its in-place flag
    (``sed -i``: prints the edit instead of making it), else its last word.

    Never the reference itself, unless that is one word: a near miss equal to it would only double the reference in
    the warm start and leave sampled groups without the reward spread GRPO learns from.
    """
    action = demo.turns[0][0].removeprefix("<bash>").removesuffix("</bash>")
    wrong = _partially_wrong(action)
    turns = ((f"<bash>{wrong}</bash>", "[exit code 0]"), ("<finish/>", ""))
    return Demonstration(demo.instruction, turns, reference=False)


def _partially_wrong(command: str) -> str:
    lines = command.splitlines()
    if len(lines) > 1:
        return "\n".join(lines[:-1])
    if ">" in command:
        return command.split(">")[0].strip()
    if " -i " in command:
        return command.replace(" -i ", " ", 1)
    return command.rpartition(" ")[0] or command  # one word: nothing shorter is a command
