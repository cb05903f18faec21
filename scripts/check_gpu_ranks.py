"""The two-rank cases of ``scripts/check_gpu.py``: one process per learner rank, started by the check.

``python scripts/check_gpu_ranks.py CASE --device cuda|cpu --out DIR`` with the launcher's environment set (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; for ``fit``, ``NODE_RANK`` and ``LOCAL_RANK=0``: each rank is a
one-device "node", so two ranks can share one GPU). Each rank writes ``DIR/rank<r>.json``.

Cases:

* ``collectives``: tslightning's own collectives over the real default group (NCCL on a GPU; on a CPU the NCCL
  stand-in of the tests, which rejects host tensors as NCCL does and blocks as NCCL does), then the fast rank-failure
  path: rank 1 fails with an out-of-memory error while rank 0 waits in a data collective for it.
* ``fsdp``: ``fit`` under FSDP2 on the two ranks, two updates.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def collectives(device: str, out: Path) -> dict:
    from tslightning.distributed.collectives import control_group
    from tslightning.distributed.failure_watch import start_watch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if device == "cuda" else _standin()
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    control_group(timedelta(seconds=300))
    start_watch(heartbeat_timeout_s=10.0, poll_s=0.2, grace_s=1.0)
    on = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    record = {"rank": rank, "backend": dist.get_backend(), "checks": _collective_checks(rank, world, on)}
    record["failure"] = _failure_path(rank, on)
    return record


def _standin() -> str:
    """The NCCL stand-in of the tests when the source tree has them, else plain gloo."""
    sys.path.insert(0, str(ROOT / "tests" / "distributed"))
    try:
        import nccl_standin
    except ImportError:
        return "gloo"
    nccl_standin.register()
    return nccl_standin.NAME


def _collective_checks(rank: int, world: int, device: torch.device) -> dict[str, bool]:
    from tslightning.distributed.collectives import (
        all_reduce_sum,
        control_all_gather,
        control_all_reduce,
        control_broadcast,
        send_receive,
    )
    from tslightning.distributed.rank_failure import agree_to_step, exchange_status

    total = world * (world + 1) / 2
    on_device = all_reduce_sum(torch.full((4096,), rank + 1.0, device=device), device)
    host = all_reduce_sum(torch.full((8,), rank + 1.0), device)  # host statistics reduced on the device
    row = torch.arange(4, dtype=torch.float32, device=device) + 100 * rank  # one ring step: to rank + 1
    received = send_receive(row, (rank + 1) % world, (rank - 1) % world, 4, torch.float32, device)
    expected_row = torch.arange(4, dtype=torch.float32) + 100 * ((rank - 1) % world)
    agree_to_step(0)
    return {
        "control all-reduce of a host flag": float(control_all_reduce(torch.tensor([rank + 1.0]))[0]) == total,
        "data all-reduce on the device": bool((on_device == total).all()) and on_device.device == device,
        "host statistics reduced on the device, copied back": bool((host == total).all()) and host.device.type == "cpu",
        "ring step of gradient rows on the device": torch.equal(received.cpu(), expected_row)
        and received.device == device,
        "control all-gather of objects": control_all_gather(rank) == list(range(world)),
        "control broadcast of an object": control_broadcast("from rank 0" if rank == 0 else None) == "from rank 0",
        "lock-step status exchange": exchange_status(0, rank + 1) == list(range(1, world + 1)),
    }


def _failure_path(rank: int, device: torch.device) -> dict:
    """Rank 1 runs out of memory mid-pass; rank 0 waits in a data collective it will never join (NCCL: a host sync
    on the collective's kernel). Both must raise RankFailureError within seconds, not after the 120 s timeout."""
    from tslightning.distributed.collectives import all_reduce_sum
    from tslightning.distributed.rank_failure import RankFailureError, agree_to_step, reported_to_ranks

    start = time.monotonic()
    try:
        with reported_to_ranks(1):
            if rank == 1:
                time.sleep(1.0)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected by check_gpu)")
            if device.type == "cuda":
                float(all_reduce_sum(torch.ones(1, device=device), device).sum())  # waits on the NCCL kernel
            else:
                dist.all_gather_object([None] * dist.get_world_size(), "data")  # the stand-in's data group
        agree_to_step(1)  # the barrier's agreement, where a pass whose collective was aborted ends up
        outcome = "no error"
    except RankFailureError as error:
        outcome = f"RankFailureError: {error}"
    return {"outcome": outcome, "seconds": time.monotonic() - start}


def fsdp(device: str, out: Path) -> dict:
    """``fit`` under FSDP2 on this rank and the other; what each rank saw."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_gpu_stages import fit_arguments

    from tslightning.distributed.learner_strategy import LearnerSettings
    from tslightning.loop.fit import CheckpointSettings, fit

    learner = LearnerSettings(devices=1, num_nodes=2, strategy="fsdp", timeout_s=300)
    result = fit(
        **fit_arguments(device, out / "run", updates=2, learner=learner, checkpoint=CheckpointSettings(enabled=False))
    )
    return {
        "rank": int(os.environ["RANK"]),
        "mean_rewards": result.mean_rewards,
        "peak_mb": result.peak_learner_memory_mb,
    }


CASES = {"collectives": collectives, "fsdp": fsdp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    try:
        record = CASES[args.case](args.device, out)
    except Exception:
        record = {"crash": traceback.format_exc()}
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record, indent=2, default=str))
    sys.stdout.flush()
    os._exit(0)  # no teardown: after the failure path the groups are aborted, and the peer may already be gone


if __name__ == "__main__":
    main()
