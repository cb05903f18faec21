"""Train any agent harness: an OpenAI-compatible gateway in front of the rollout engine, at zero staleness.

A harness (mini-swe-agent, a user's own) talks to :class:`OpenAIGateway` as to any OpenAI-compatible server; every
call is one turn of its attempt, sampled token-in/token-out at the update's policy version, recorded with the exact
sampled ids and log-probs; its commands run in the attempt's sandbox. :class:`HarnessAgent` runs one harness process
per attempt in place of the built-in agent loop (``fit --harness.name ...``).
"""

from tslightning.rollout.gateway.harness_agent import HarnessAgent, HarnessError
from tslightning.rollout.gateway.harness_process import HarnessConnection, HarnessProgram
from tslightning.rollout.gateway.harness_trajectory import HarnessTrajectory
from tslightning.rollout.gateway.openai_gateway import OpenAIGateway

__all__ = ["HarnessAgent", "HarnessConnection", "HarnessError", "HarnessProgram", "HarnessTrajectory", "OpenAIGateway"]
