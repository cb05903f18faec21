"""mini-swe-agent on one tslightning attempt, and the environment class that runs its commands in our sandbox.

This file runs under mini-swe-agent's own interpreter (its own virtual environment: ``pip install mini-swe-agent``),
never imports tslightning, and needs nothing but mini-swe-agent and the standard library:

* :class:`SandboxEnvironment` is a mini-swe-agent environment (its ``Environment`` protocol: ``execute``,
  ``get_template_vars``, ``serialize``). ``execute`` posts the command to the gateway's command route with the
  attempt's key; the gateway runs it in the attempt's live sandbox under the task's limits and answers its output and
  exit code. Like mini-swe-agent's own environments it ends the run (``Submitted``) when a command's output starts
  with ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``. Usable on its own, e.g. ``mini --environment-class
  mini_swe_agent_environment.SandboxEnvironment`` with this directory on ``PYTHONPATH``.
* ``main`` runs mini-swe-agent's ``DefaultAgent`` with its text-based litellm model, configured by its own shipped
  ``mini_textbased.yaml`` (its prompts, action regex, observation and format-error templates), merged with the
  ``--config`` files given, then with the attempt's connection: ``model_name: openai/<TSLIGHTNING_MODEL>`` and
  ``model_kwargs: {api_base: OPENAI_BASE_URL, api_key: OPENAI_API_KEY}`` — litellm's ordinary settings for an
  OpenAI-compatible server — and ``step_limit: TSLIGHTNING_MAX_TURNS``. Its trajectory is saved as
  ``trajectory.json`` in the working directory. ``--print-config`` prints the merged configuration as JSON instead
  (the trainer reads the templates from it, to warm-start the policy in the harness's own format). A ``--config``
  name is looked up as mini-swe-agent looks it up (the working directory, ``MSWEA_CONFIG_DIR`` — by default this
  file's directory, which holds ``mini_swe_agent_compact.yaml`` — then its own configs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SUBMIT_LINE = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
BASE_CONFIG = "mini_textbased.yaml"
"""mini-swe-agent's shipped configuration for text actions (the gateway renders no tool calls)."""


@dataclass
class SandboxEnvironmentConfig:
    command_url: str
    timeout: int = 3600
    """Seconds to wait for the gateway's answer (the sandbox bounds the command itself: Table 6's 120 s)."""

    def model_dump(self, mode: str | None = None) -> dict[str, Any]:
        return asdict(self)


class SandboxEnvironment:
    """Runs mini-swe-agent's commands in a tslightning attempt's sandbox, through the gateway.

    Args:
        command_url: The gateway's command route (default: ``TSLIGHTNING_COMMAND_URL``).
        api_key: The attempt's key (default: ``OPENAI_API_KEY``); never shown in templates or trajectories.
        timeout: Seconds to wait for one command's answer.
    """

    def __init__(self, *, command_url: str | None = None, api_key: str | None = None, timeout: int = 3600, **_):
        self.config = SandboxEnvironmentConfig(command_url or os.environ["TSLIGHTNING_COMMAND_URL"], timeout)
        self._key = api_key or os.environ["OPENAI_API_KEY"]

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]`` (in ``cwd`` if given) in the sandbox; mini-swe-agent's output dict."""
        command = action.get("command", "")
        if cwd:
            command = f"cd {shlex.quote(cwd)} && {command}"
        try:
            answer = self._post({"command": command})
        except (urllib.error.URLError, OSError, ValueError) as error:
            output = {"output": "", "returncode": -1, "exception_info": f"the sandbox did not run the command: {error}"}
        else:
            failed = "the command timed out" if answer.get("timed_out") else answer.get("limit_hit") or ""
            returncode = answer.get("exit_code")
            output = {
                "output": answer.get("output", ""),
                "returncode": -1 if returncode is None else returncode,
                "exception_info": f"An error occurred while executing the command: {failed}" if failed else "",
            }
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The configuration and the machine (the sandbox runs on the host's kernel), as mini's local one gives."""
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict[str, Any]:
        kind = f"{type(self).__module__}.{type(self).__name__}"
        return {"info": {"config": {"environment": self.config.model_dump(), "environment_type": kind}}}

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.config.command_url,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {self._key}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:  # an OpenAI-format error: the attempt is closed, or no sandbox
            message = json.loads(error.read() or b"{}").get("error", {}).get("message", str(error))
            raise ValueError(message) from None

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_LINE and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )


def merged_config(specs: list[str]) -> dict[str, Any]:
    """mini-swe-agent's shipped text-action configuration, then ``specs`` (files or ``key=value``), merged as its
    ``mini`` command merges ``-c`` options; the model class is the text-based one unless a spec names another."""
    from minisweagent.config import get_config_from_spec
    from minisweagent.utils.serialize import recursive_merge

    ours = {"model": {"model_class": "litellm_textbased", "cost_tracking": "ignore_errors"}}
    return recursive_merge(get_config_from_spec(BASE_CONFIG), ours, *(get_config_from_spec(s) for s in specs))


def _connection() -> dict[str, Any]:
    """The attempt's connection, from the environment the trainer set (overrides every config)."""
    return {
        "model": {
            "model_name": "openai/" + os.environ["TSLIGHTNING_MODEL"],
            "model_kwargs": {"api_base": os.environ["OPENAI_BASE_URL"], "api_key": os.environ["OPENAI_API_KEY"]},
        },
        "agent": {"step_limit": int(os.environ["TSLIGHTNING_MAX_TURNS"]), "cost_limit": 0},
    }


def _quiet_defaults() -> None:
    """No banner, no config written to the user's home, no price list fetched, no retry storms on refusals."""
    for name, value in {
        "MSWEA_SILENT_STARTUP": "1",
        "MSWEA_GLOBAL_CONFIG_DIR": str(Path.cwd() / ".mini-swe-agent"),
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "MSWEA_COST_TRACKING": "ignore_errors",
        "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
        "MSWEA_CONFIG_DIR": str(Path(__file__).parent),  # finds mini_swe_agent_compact.yaml beside this file
    }.items():
        os.environ.setdefault(name, value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="mini-swe-agent on one tslightning attempt")
    parser.add_argument("--config", action="append", default=[], help="a config file or key=value, merged in order")
    parser.add_argument("--print-config", action="store_true", help="print the merged configuration as JSON")
    args = parser.parse_args(argv)
    _quiet_defaults()
    if args.print_config:
        print(json.dumps(merged_config(args.config), default=str))
        return 0
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models import get_model
    from minisweagent.utils.serialize import recursive_merge

    config = recursive_merge(merged_config(args.config), _connection())
    config["agent"]["output_path"] = Path.cwd() / "trajectory.json"
    environment = SandboxEnvironment(**{k: v for k, v in config.get("environment", {}).items() if k == "timeout"})
    agent = DefaultAgent(get_model(config=config["model"]), environment, **config["agent"])
    task = Path(os.environ["TSLIGHTNING_INSTRUCTION_FILE"]).read_text().strip()
    result = agent.run(task)
    print(json.dumps({"exit_status": result.get("exit_status"), "calls": agent.n_calls}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
