"""``fit``'s harness start-up: the warm start's layout for a harness, and this rank's gateway with the agent that runs
the harness once per attempt against it (README: Train your own agent harness)."""

from __future__ import annotations

from pathlib import Path

from tslightning.loop.settings import RolloutSettings
from tslightning.loop.startup import agent_limits
from tslightning.rollout.gateway import OpenAIGateway
from tslightning.rollout.gateway.conversation import ChatTokens
from tslightning.rollout.harness import HarnessAgent, HarnessProgram
from tslightning.rollout.harness.mini_swe_agent import MiniSweAgentFormat, mini_swe_agent_config, mini_swe_agent_program
from tslightning.rollout.harness.settings import HarnessSettings


def warm_start_format(harness: HarnessSettings):
    """The warm start's layout for ``harness`` (tokenizer → format), or ``None`` for the built-in loop's: mini-swe-agent
    demonstrates in its own configuration's messages (read through its interpreter)."""
    if harness.name != "mini_swe_agent":
        return None
    config = mini_swe_agent_config(harness.python, harness.configs)
    return lambda tokenizer: MiniSweAgentFormat(ChatTokens(tokenizer), config)


def start_harness(
    harness: HarnessSettings, engine, tokenizer, rollout: RolloutSettings, policy_config, seed: int, out
) -> HarnessAgent:
    """This rank's gateway in front of ``engine`` (started, on ``harness.host``, at a port the OS picks unless
    ``harness.port`` is given) and the agent that runs ``harness``'s program once per attempt against it. A rewritten
    history is cut into segments, each scored under its own context, unless ``harness.allow_segments`` is false
    (:mod:`tslightning.rollout.gateway.trajectory`)."""
    gateway = OpenAIGateway(
        engine,
        tokenizer,
        agent_limits(rollout, policy_config),
        seed,
        model_name=harness.model_name,
        host=harness.host,
        port=harness.port,
        allow_segments=harness.allow_segments,
        max_concurrent_commands=rollout.max_concurrent_attempts,
    ).start()
    if harness.name == "mini_swe_agent":
        program = mini_swe_agent_program(harness.python, harness.configs, harness.timeout_s)
    else:
        program = HarnessProgram(list(harness.command), timeout_s=harness.timeout_s)
    return HarnessAgent(gateway, program, Path(harness.log_dir) if harness.log_dir else Path(out) / "attempts")
