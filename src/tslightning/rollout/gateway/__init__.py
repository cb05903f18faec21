"""The OpenAI-compatible gateway in front of the rollout engine, at zero staleness.

A harness (mini-swe-agent, a user's own; :mod:`tslightning.rollout.harness`) talks to :class:`OpenAIGateway` as to
any OpenAI-compatible server; every call is one turn of its attempt, sampled token-in/token-out at the update's policy
version, recorded with the exact sampled ids and log-probs (its schema, errors, conversation, attempt sessions and
log live here); its commands run in the attempt's sandbox.

Rule: never imports ``harness/`` (the harness drives the gateway, not the other way round).
"""

from tslightning.rollout.gateway.server import OpenAIGateway
from tslightning.rollout.gateway.trajectory import HarnessTrajectory

__all__ = ["HarnessTrajectory", "OpenAIGateway"]
