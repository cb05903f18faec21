"""tslightning's own collectives on two gloo ranks whose default group rejects host tensors, as NCCL does.

Control messages must travel over a gloo side group, data over the group that serves its device, and a collective's
type error must surface as itself, not as a dead rank. The stand-in (``nccl_standin.py``) is checked to reject a
plain host-tensor all-reduce, so a test here fails if the code under test ever sends one to the default group.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import nccl_standin
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tslightning.distributed import collectives
from tslightning.distributed.rank_failure import RankFailureError, agree_to_step, exchange_status, reported_to_ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(rank: int, port: int, results) -> None:
    nccl_standin.register()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl_standin", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    outcome = {}
    try:
        try:
            dist.all_reduce(torch.ones(1))
            outcome["plain_host_all_reduce"] = "accepted"
        except RuntimeError as error:
            outcome["plain_host_all_reduce"] = str(error)
        outcome["control"] = collectives.control_all_reduce(torch.tensor([float(rank + 1)])).tolist()
        outcome["data"] = collectives.all_reduce_sum(
            torch.full((3,), float(rank + 1), dtype=torch.float64), "cpu"
        ).tolist()
        agree_to_step(0)
        outcome["ticks"] = exchange_status(0, rank + 1)
        try:
            with reported_to_ranks(1):
                if rank == 1:
                    raise ValueError("rank 1's ingest failed")
            agree_to_step(1)
        except RankFailureError as error:
            outcome["failure"] = str(error)
        try:
            collectives.control_all_reduce(torch.ones(1, dtype=torch.uint16))  # gloo: "Invalid scalar type"
            outcome["type_error"] = "accepted"
        except collectives.CollectiveFailure as error:
            outcome["type_error"] = f"CollectiveFailure: {error}"
        except RuntimeError as error:
            outcome["type_error"] = f"{type(error).__name__}: {error}"
        outcome["rejected"] = list(nccl_standin.rejected)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    results[rank] = outcome


@pytest.fixture(scope="module")
def outcomes():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_ranks, args=(_free_port(), results), nprocs=2, join=True)
        return dict(results)


def test_the_stand_in_rejects_a_host_tensor_on_the_default_group(outcomes):
    for rank in (0, 1):
        assert "No backend type associated with device type cpu" in outcomes[rank]["plain_host_all_reduce"]


def test_control_messages_and_host_data_travel_over_a_gloo_side_group(outcomes):
    for rank in (0, 1):
        assert outcomes[rank]["control"] == [3.0]
        assert outcomes[rank]["data"] == [3.0, 3.0, 3.0]
        assert outcomes[rank]["ticks"] == [1, 2]
        assert outcomes[rank]["rejected"] == [outcomes[rank]["rejected"][0]]  # only the deliberate plain all-reduce


def test_a_failed_rank_fails_the_update_on_both_over_the_side_group(outcomes):
    for rank in (0, 1):
        assert "update 1 failed on learner rank(s) [1] of 2" in outcomes[rank]["failure"]


def test_a_type_error_is_reported_as_itself_not_as_a_dead_rank(outcomes):
    for rank in (0, 1):
        error = outcomes[rank]["type_error"]
        assert error == "RuntimeError: Invalid scalar type", error


def test_peer_failures_are_told_apart_from_usage_errors():
    assert collectives._peer_failed(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"))
    assert collectives._peer_failed(RuntimeError("Timed out waiting 30000ms for recv operation to complete"))
    assert not collectives._peer_failed(RuntimeError("No backend type associated with device type cpu"))
    assert not collectives._peer_failed(RuntimeError("Invalid scalar type"))
