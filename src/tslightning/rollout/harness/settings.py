"""``fit``'s ``harness`` settings: which agent acts in each attempt — the built-in loop, mini-swe-agent, or any program
that speaks the OpenAI API — and the gateway it talks to (README: Train your own agent harness)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["HarnessSettings"]


@dataclass
class HarnessSettings:
    """The agent harness of each attempt and its gateway."""

    name: Literal["builtin", "mini_swe_agent", "command"] = "builtin"
    """``builtin``: tslightning's agent loop (one ``<bash>`` action per turn); ``mini_swe_agent``: mini-swe-agent
    (its own loop and prompts) through the gateway; ``command``: your own harness program (``command``), started once
    per attempt with its connection in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` (and ``TSLIGHTNING_*``)."""
    command: list[str] | None = None
    """``command``: the harness program's command line, run once per attempt in the attempt's log directory."""
    python: str | None = None
    """``mini_swe_agent``: the interpreter of the environment mini-swe-agent is installed in (its own virtual
    environment; ``scripts/setup.sh`` makes ``.venv-mini-swe-agent``), e.g. ``.venv-mini-swe-agent/bin/python``."""
    configs: list[str] = field(default_factory=list)
    """``mini_swe_agent``: configuration files (or ``key=value``) merged over its shipped ``mini_textbased.yaml``, as
    its ``mini -c`` merges them; the connection and ``step_limit`` (``rollout.max_turns``) are set by the gateway."""
    host: str = "127.0.0.1"
    """Where the gateway listens (loopback: the harnesses run on this host)."""
    port: int = 0
    """The gateway's port; 0: one the OS picks (each learner rank runs its own gateway)."""
    model_name: str = "tslightning-policy"
    """The model id harnesses name in their calls."""
    timeout_s: float = 1800.0
    """Wall-clock seconds one attempt's harness process may run before it is ended (its process group)."""
    allow_segments: bool = True
    """A call whose history does not extend its attempt's (the harness summarised, dropped or edited messages) opens
    a segment scored under its own context; ``False``: it is refused (``history_rewritten``) and the attempt ends."""
    log_dir: str | None = None
    """Per-attempt logs (calls, commands in the sandbox, refusals, the harness's output); ``None``:
    ``<out_dir>/attempts``."""

    @property
    def enabled(self) -> bool:
        return self.name != "builtin"

    def problems(self, objective: str, schedule: str, context_backward: str, environment: str, warm_start_steps: int):
        """Everything wrong with these settings for a run, each naming the key (``harness.*``) and the fix."""
        if not self.enabled:
            return [f"harness.{key} applies to a harness; harness.name is builtin" for key in self._harness_only()]
        problems = self._program_problems()
        if schedule == "fully_async":
            problems.append(
                "harness: schedule fully_async swaps weights under running attempts; a harness attempt samples every "
                "call at one version: use sync, thundersync or async"
            )
        if context_backward == "boundary":
            problems.append(
                "harness: context_backward boundary shares a group's prompt, which a harness writes itself (it may "
                "differ between a group's attempts): set context_backward recompute"
            )
        if environment != "terminal":
            problems.append(f"harness: rollout.environment {environment!r} is the built-in agent's gauge; use terminal")
        if warm_start_steps and self.name == "command":
            problems.append(
                "harness: the warm start demonstrates in the built-in or mini-swe-agent's format; a command harness "
                "brings a policy that speaks its own: set warm_start.steps 0"
            )
        if not 0 <= self.port < 65536 or not self.timeout_s > 0 or not self.model_name:
            problems.append(
                f"harness.port must be in [0, 65536), harness.timeout_s > 0 and harness.model_name non-empty; got "
                f"{self.port}, {self.timeout_s}, {self.model_name!r}"
            )
        return problems + ([] if objective in ("grpo", "opd") else [f"harness: unknown objective {objective!r}"])

    def _program_problems(self) -> list[str]:
        if self.name == "command":
            if not self.command:
                return ["harness.command is empty: give the harness program's command line"]
            if shutil.which(self.command[0]) is None:
                return [f"harness.command: {self.command[0]} is not an executable program"]
            return []
        if self.python is None:
            return [
                "harness.python: give the interpreter of the environment mini-swe-agent is installed in "
                "(scripts/setup.sh makes .venv-mini-swe-agent: harness.python .venv-mini-swe-agent/bin/python)"
            ]
        if shutil.which(self.python) is None:
            return [f"harness.python {self.python} is not an executable program; give mini-swe-agent's interpreter"]
        return []

    def _harness_only(self) -> list[str]:
        defaults = HarnessSettings()
        keys = ("command", "python", "configs", "allow_segments")
        return [key for key in keys if getattr(self, key) != getattr(defaults, key)]
