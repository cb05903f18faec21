"""SessionRouter's choice for learner ranks sharing the servers: each rank's ties start at its own server."""

from __future__ import annotations

from tslightning.rollout.session_routing import SessionRouter


def test_each_rank_starts_at_its_own_server_and_then_balances_by_load():
    ranks = [SessionRouter(3, first=rank) for rank in range(3)]
    assert [router.send("g0/0") for router in ranks] == [0, 1, 2]  # equal shares spread from the first request
    rank1 = ranks[1]
    assert [rank1.send(f"g{i}/0") for i in range(1, 3)] == [2, 0]  # then the least loaded, ties wrapping from 1
    rank1.done(2)
    assert rank1.send("g3/0") == 2
    assert SessionRouter(2, first=5).send("g0/0") == 1  # a rank index past the servers wraps
