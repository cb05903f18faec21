"""Train any agent harness through the gateway: one harness process per attempt in place of the built-in agent loop
(``fit --harness.name ...``).

:class:`HarnessAgent` starts the harness (:class:`HarnessProgram`) against an attempt's gateway connection and turns
its calls into the attempt's trajectory. ``programs/`` holds code run under the harness's own interpreter.

Rule: ``programs/`` imports only the standard library (and the harness's own package); nothing in it imports
tslightning.
"""

from tslightning.rollout.harness.agent import HarnessAgent, HarnessError
from tslightning.rollout.harness.process import HarnessConnection, HarnessProgram

__all__ = ["HarnessAgent", "HarnessConnection", "HarnessError", "HarnessProgram"]
