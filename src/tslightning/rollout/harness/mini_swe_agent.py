"""mini-swe-agent as a harness: its program (run under its own interpreter), and its message format for the warm start.

The program is :mod:`~tslightning.rollout.harness.programs.mini_swe_agent_environment` run by the interpreter of the
environment mini-swe-agent is installed in (``harness.python``): mini-swe-agent's own ``DefaultAgent``, text-based
litellm model and shipped ``mini_textbased.yaml`` prompts, talking to the gateway through litellm's OpenAI settings,
its commands run in the attempt's sandbox.

:class:`MiniSweAgentFormat` lays a demonstration out exactly as a mini-swe-agent attempt reaches the learner: the
configuration's system and instance templates rendered as mini-swe-agent renders them (Jinja2, strict), each action
in its ``mswea_bash_command`` block, each observation through its observation template, the finish as its submit
command, all tokenized through the gateway's own continuation rule — so a policy warm-started on it meets, at RL
time, the token layout it was fitted on.
"""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tslightning.rollout.gateway.conversation import ChatTokens, SegmentContext
from tslightning.rollout.harness.process import HarnessProgram

__all__ = ["MiniSweAgentFormat", "RUNNER", "mini_swe_agent_config", "mini_swe_agent_program"]

RUNNER = Path(__file__).parent / "programs" / "mini_swe_agent_environment.py"
"""The runner and environment class, executed by mini-swe-agent's interpreter."""
SUBMIT_COMMAND = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def mini_swe_agent_program(python: str, configs: Sequence[str] = (), timeout_s: float = 900.0) -> HarnessProgram:
    """mini-swe-agent on one attempt, run by ``python`` with its configuration merged from ``configs``."""
    options = [part for config in configs for part in ("--config", str(config))]
    return HarnessProgram([_interpreter(python), str(RUNNER), *options], timeout_s=timeout_s)


def mini_swe_agent_config(python: str, configs: Sequence[str] = (), timeout_s: float = 120.0) -> dict[str, Any]:
    """The configuration an attempt's mini-swe-agent runs with (before its connection), read through ``python``.

    Raises:
        ValueError: ``python`` cannot run mini-swe-agent (not installed there, or a config it cannot read).
    """
    options = [part for config in configs for part in ("--config", str(config))]
    try:
        done = subprocess.run(
            [_interpreter(python), str(RUNNER), "--print-config", *options],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise ValueError(f"harness.python {python} cannot run mini-swe-agent: {error}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"harness.python {python} cannot run mini-swe-agent with {list(configs)}: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class MiniSweAgentFormat:
    """Demonstrations laid out as mini-swe-agent's calls reach the learner through the gateway.

    Args:
        chat: The gateway's view of the policy tokenizer.
        config: The merged mini-swe-agent configuration (:func:`mini_swe_agent_config`).
    """

    def __init__(self, chat: ChatTokens, config: dict[str, Any]) -> None:
        self.chat, self.config = chat, config

    def first_messages(self, instruction: str) -> list[dict[str, str]]:
        """The system and instance messages mini-swe-agent opens an attempt with."""
        agent = self.config["agent"]
        variables = self._variables(instruction.strip())
        return [
            {"role": "system", "content": _render(agent["system_template"], variables)},
            {"role": "user", "content": _render(agent["instance_template"], variables)},
        ]

    def demonstration_tokens(self, demo) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids ``(T,)`` and action mask ``(T,)`` of a built-in-format demonstration in mini-swe-agent's format:
        each ``<bash>`` action becomes a ``mswea_bash_command`` block and ``<finish/>`` its submit command."""
        messages = self.first_messages(demo.instruction)
        ids, mask, segment = [], [], None
        for action, _ in demo.turns:
            call = self.chat.continuation(segment, self.chat.render(messages))
            content = _action_block(action)
            sampled = self.chat.encode(content) + (self.chat.end_of_turn,)
            ids += [*call.new_ids, *sampled]
            mask += [False] * len(call.new_ids) + [True] * len(sampled)
            segment = SegmentContext(call.prompt_ids + sampled, call.text + content + self.chat.end_of_turn_text)
            observation = self._observation({"output": "", "returncode": 0, "exception_info": ""}, demo.instruction)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": observation}]
        return torch.tensor(ids), torch.tensor(mask)

    def _observation(self, output: dict[str, Any], instruction: str) -> str:
        template = self.config["model"]["observation_template"]
        return _render(template, {**self._variables(instruction.strip()), "output": output})

    def _variables(self, task: str) -> dict[str, Any]:
        """What mini-swe-agent's templates see at an attempt's start (agent config, machine, counters, task)."""
        counters = {"n_model_calls": 0, "model_cost": 0.0, "elapsed_seconds": 0}
        return {**self.config["agent"], **platform.uname()._asdict(), **counters, "task": task}


def _interpreter(python: str) -> str:
    """``python`` as an absolute path (the harness runs in another directory), found on ``PATH`` if it is a name;
    a virtual environment's interpreter is kept as its link, so it runs in that environment."""
    return str(Path(python).absolute()) if "/" in python else shutil.which(python) or python


def _action_block(action: str) -> str:
    """A built-in action as mini-swe-agent's text action."""
    if action.strip() == "<finish/>":
        command = SUBMIT_COMMAND
    else:
        command = action.strip().removeprefix("<bash>").removesuffix("</bash>")
    return f"```mswea_bash_command\n{command}\n```"


def _render(template: str, variables: dict[str, Any]) -> str:
    from jinja2 import StrictUndefined, Template

    return Template(template, undefined=StrictUndefined).render(**variables)
