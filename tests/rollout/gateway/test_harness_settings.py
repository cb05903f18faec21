"""``harness`` settings: what a run with a harness refuses, one line each naming the key and the fix."""

from __future__ import annotations

import sys

from tslightning.rollout.harness.settings import HarnessSettings

RUN = ("grpo", "thundersync", "recompute", "terminal", 0)


def test_the_builtin_agent_takes_no_harness_keys():
    assert HarnessSettings().problems(*RUN) == []
    assert HarnessSettings(python="/usr/bin/python3").problems(*RUN) == [
        "harness.python applies to a harness; harness.name is builtin"
    ]


def test_a_harness_needs_its_program_and_a_schedule_that_keeps_one_version_per_attempt():
    (missing,) = HarnessSettings(name="mini_swe_agent").problems(*RUN)
    assert missing.startswith("harness.python: give the interpreter") and ".venv-mini-swe-agent" in missing
    assert HarnessSettings(name="command").problems(*RUN) == [
        "harness.command is empty: give the harness program's command line"
    ]
    harness = HarnessSettings(name="command", command=[sys.executable, "harness.py"])
    assert harness.problems(*RUN) == []
    problems = harness.problems("grpo", "fully_async", "boundary", "simulated_tool", 10)
    assert [p.split(":")[0] for p in problems] == ["harness"] * 4
    assert "fully_async" in problems[0] and "context_backward recompute" in problems[1]
    assert "warm_start.steps 0" in problems[3]
    assert "harness.port" in HarnessSettings(name="command", command=["sh"], port=-1).problems(*RUN)[0]
