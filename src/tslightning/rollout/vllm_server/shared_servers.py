"""Several learner ranks on the same vLLM servers: global rank 0's engine publishes, the others follow it.

Each rank's :class:`~tslightning.rollout.vllm_server.engine.VLLMServerEngine` sends its own share of the
trajectories (routing stays local), but only the ``publisher`` joins the weight-transfer groups and publishes θ_0 and
every θ_{k+1}, once per server. After each publication it reports :meth:`SharedServers.served` (the version, the
adapter name, the servers that acknowledged it, a restarted replica's new URL among them); the loop sends that to
the other ranks, whose ``follower`` engines :meth:`SharedServers.follow` it. Every rank still checks every token's
weight version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ServedVersion", "SharedServers"]


@dataclass(frozen=True)
class ServedVersion:
    """What the publisher's servers serve after a publication, sent to the other learner ranks' engines.

    Attributes:
        policy_version: The version every listed server acknowledged (its ``/weight_info``).
        model: The adapter's name requests must name (a LoRA run), or ``None``: the base model.
        urls: Server index → URL of each server in rotation (a restarted replica has a new URL).
    """

    policy_version: int
    model: str | None
    urls: dict[int, str]


class SharedServers:
    """The sharing side of :class:`~tslightning.rollout.vllm_server.engine.VLLMServerEngine` (a mixin over its
    ``sharing``, ``urls``, ``_gate``, ``_router``, ``_policy_version`` and ``_model``)."""

    sharing: str
    urls: list[str]
    _gate: Any
    _router: Any
    _policy_version: int
    _model: str | None

    @property
    def shared_servers(self) -> bool:
        """Whether several learner ranks use these servers (global rank 0's engine publishes, the others follow)."""
        return self.sharing != "none"

    def served(self) -> ServedVersion:
        """The version, adapter and servers in rotation now: after a publication, what the followers adopt."""
        with self._gate:
            urls = {server: self.urls[server] for server in self._router.alive}
            return ServedVersion(self._policy_version, self._model, urls)

    def follow(self, served: ServedVersion) -> None:
        """A follower adopts the publisher's publication: from now on its requests are sent at
        ``served.policy_version`` (naming ``served.model``) to the servers in ``served.urls`` only — a restarted
        replica rejoins here, once the publisher published the current version to it; a server the publisher lost
        leaves rotation. Requests in flight (there are none between batches) finish first.

        Raises:
            RuntimeError: If this engine publishes itself (``sharing`` is not ``follower``).
            ValueError: If ``served.policy_version`` does not increase.
        """
        if self.sharing != "follower":
            raise RuntimeError(f"follow() is for a follower's engine; this one's sharing is {self.sharing!r}")
        with self._gate:
            self._check_next_version(served.policy_version)
            self._gate.wait_for(lambda: not any(self._router.in_flight))
            for server in list(self._router.alive):
                if server not in served.urls:
                    self._router.drop(server)
            for server, url in served.urls.items():
                self.urls[server] = url.rstrip("/")
                self._router.readmit(server)
            self._policy_version, self._model = served.policy_version, served.model
