"""SessionRouter's choice for learner ranks sharing the servers: each rank's ties start at its own server."""

from __future__ import annotations

from tslightning.rollout.vllm_server.session_routing import SessionRouter


def test_each_rank_starts_at_its_own_server_and_then_balances_by_load():
    ranks = [SessionRouter(3, first=rank) for rank in range(3)]
    assert [router.send("g0/0") for router in ranks] == [0, 1, 2]  # equal shares spread from the first request
    rank1 = ranks[1]
    assert [rank1.send(f"g{i}/0") for i in range(1, 3)] == [2, 0]  # then the least loaded, ties wrapping from 1
    rank1.done(2)
    assert rank1.send("g3/0") == 2
    assert SessionRouter(2, first=5).send("g0/0") == 1  # a rank index past the servers wraps


def test_a_groups_members_spread_over_the_servers_whatever_the_load():
    router = SessionRouter(2)
    first = router.send("u0/p0/task/0")
    router.done(first)  # idle again: by load alone the next member would go to the same server
    second = router.send("u0/p0/task/1")
    assert {first, second} == {0, 1}
    router.done(second)
    assert router.send("u0/p0/task/0") == first  # a trajectory's later turns stay where its prefix is cached
    assert router.send("plain") in (0, 1) and router.send("u0/p1/other/0") == 0  # another group starts afresh
