"""Which server each rollout request goes to (App. D.2): session affinity for a trajectory's turns; for a new
trajectory the server holding the fewest of its group's trajectories, then the least loaded — a group's members spread
over the servers, so a long group's members decode side by side instead of queueing on one server.

Several learner ranks sharing the servers each route only their own trajectories (the choice stays local): a global
least-loaded choice would put a collective or a shared counter on every request's path, while each rank's share of a
batch is the same size and starts at another server (``first``), and the servers' continuous batching absorbs what
imbalance remains.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["SessionRouter"]

_SESSIONS_KEPT = 65536
"""Trajectories whose server the router remembers (oldest forgotten first)."""


class SessionRouter:
    """Which server each request goes to: a session's first request to the server holding the fewest sessions of its
    group (the session id's part before its last ``/``: ``<group>/<trajectory>``), then with the fewest requests in
    flight; its later ones to the same server (its prefix cache holds the earlier turns). Not thread-safe.

    Ties go to the first server from ``first`` on (in index order, wrapping): learner ranks sharing the servers each
    route their own trajectories, and each starts at another server, so equal shares spread from the first request.

    Args:
        servers: How many servers there are.
        sessions_kept: Sessions remembered, the least recently used forgotten first.
        first: The server ties start from (a learner rank's index, modulo ``servers``).
    """

    def __init__(self, servers: int, sessions_kept: int = _SESSIONS_KEPT, first: int = 0) -> None:
        self.in_flight = [0] * servers
        self.alive = list(range(servers))
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._groups: OrderedDict[str, list[int]] = OrderedDict()  # group → sessions per server
        self._kept = sessions_kept
        self._first = first

    def send(self, session: str) -> int:
        """The server of ``session``'s next request, counted in flight until :meth:`done`."""
        server = self._sessions.get(session)
        if server is None or server not in self.alive:
            members = self._group_members(session)
            order = len(self.in_flight)
            server = min(self.alive, key=lambda s: (members[s], self.in_flight[s], (s - self._first) % order))
            members[server] += 1
        self._sessions[session] = server
        self._sessions.move_to_end(session)
        if len(self._sessions) > self._kept:
            self._sessions.popitem(last=False)
        self.in_flight[server] += 1
        return server

    def _group_members(self, session: str) -> list[int]:
        """Sessions of ``session``'s group per server (the least recently used groups forgotten first); none for a
        session that names no group."""
        group, slash, _ = session.rpartition("/")
        if not slash:
            return [0] * len(self.in_flight)
        members = self._groups.setdefault(group, [0] * len(self.in_flight))
        self._groups.move_to_end(group)
        if len(self._groups) > self._kept:
            self._groups.popitem(last=False)
        return members

    def done(self, server: int) -> None:
        """A request sent to ``server`` came back."""
        self.in_flight[server] -= 1

    def drop(self, server: int) -> None:
        """``server`` stopped answering: its sessions move to the others at their next request."""
        if server in self.alive:
            self.alive.remove(server)

    def readmit(self, server: int) -> None:
        """``server`` serves again (a restarted replica that acknowledged the current version)."""
        if server not in self.alive:
            self.alive.append(server)
            self.alive.sort()
