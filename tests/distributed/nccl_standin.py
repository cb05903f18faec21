"""A stand-in for NCCL on a CPU machine: a default process group that rejects host tensors.

NCCL serves CUDA tensors only; a collective on a host tensor fails ("No backend type associated with device type
cpu"). These machines have no GPU, so the stand-in is a gloo group whose tensor collectives refuse CPU tensors with
that error — except those Lightning and PyTorch issue themselves (DDP's module-state sync, object collectives,
Lightning strategies' ``broadcast``/``barrier``/``reduce_boolean_decision``/``all_reduce``): on a GPU they place
their tensors on the root device, which on a CPU test *is* the host. So it catches what the review found: a
collective tslightning itself issues with a host tensor on the default group (rank-failure agreements, lock-step
ticks, the barrier's reductions, the publication agreement), which NCCL would reject. Its backend name is not
``gloo``, so tslightning's collectives make their gloo side group as they would next to NCCL.

It also behaves as NCCL does when a peer fails: a collective waiting for a rank that never joins it waits (no error
of its own) until the communicator is aborted — :meth:`HostTensorRejectingGroup.abort`, which
:func:`tslightning.distributed.failure_watch.abort_data_groups` calls — and then raises, as do the collectives after
it. (gloo itself cannot be aborted: each collective here is waited for in short slices that check for the abort.)

Register it with :func:`register` in every rank's process before ``init_process_group(backend="nccl_standin")``
(``tslightning fit --learner.process_group_backend nccl_standin``).
"""

from __future__ import annotations

import sys
import threading
from datetime import timedelta

import torch.distributed as dist

NAME = "nccl_standin"
_TRUSTED = (
    "torch/nn/parallel/distributed.py",  # DDP's module-state sync
    "lightning/fabric/strategies/",
    "lightning/pytorch/strategies/",
    "lightning/fabric/utilities/distributed.py",
)
_OBJECT_COLLECTIVES = {"broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list"}
rejected: list[str] = []
"""Where each rejected collective came from (this process)."""


class HostTensorRejectingGroup(dist.ProcessGroup):
    """gloo underneath; tensor collectives on host tensors from untrusted callers raise as NCCL would."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._aborted = threading.Event()

    def getBackendName(self) -> str:  # noqa: N802 - the c10d API's name
        return NAME

    def abort(self) -> None:
        """As ``ncclCommAbort``: collectives waiting now, and every later one, raise."""
        self._aborted.set()

    def allreduce(self, tensors, opts=None):
        self._check(tensors, "allreduce")
        return self._waited(self._gloo.allreduce(tensors, opts or dist.AllreduceOptions()))

    def broadcast(self, tensors, opts=None):
        self._check(tensors, "broadcast")
        return self._waited(self._gloo.broadcast(tensors, opts or dist.BroadcastOptions()))

    def allgather(self, output_tensors, input_tensors, opts=None):
        self._check(input_tensors, "allgather")
        return self._waited(self._gloo.allgather(output_tensors, input_tensors, opts or dist.AllgatherOptions()))

    def _allgather_base(self, output, input, opts=None):
        self._check([input], "all_gather_into_tensor")
        return self._waited(self._gloo._allgather_base(output, input, opts or dist.AllgatherOptions()))

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        self._check(output_tensors, "reduce_scatter")
        options = opts or dist.ReduceScatterOptions()
        return self._waited(self._gloo.reduce_scatter(output_tensors, input_tensors, options))

    def _reduce_scatter_base(self, output, input, opts=None):
        self._check([input], "reduce_scatter_tensor")
        return self._waited(self._gloo._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions()))

    def barrier(self, opts=None):
        return self._waited(self._gloo.barrier(opts or dist.BarrierOptions()))

    def _waited(self, work):
        """The finished ``work``; raises as NCCL does once the group was aborted (before or while it waits)."""
        while not work.is_completed():
            if self._aborted.wait(0.01):
                break
        if self._aborted.is_set():
            raise RuntimeError(f"{NAME}: the communicator was aborted (ncclCommAbort); collective not completed")
        return work

    def _check(self, tensors, name: str) -> None:
        if not any(t.device.type == "cpu" for t in tensors) or _trusted_caller():
            return
        caller = _first_outside_torch()
        rejected.append(f"{name} from {caller}")
        raise RuntimeError(f"No backend type associated with device type cpu ({NAME}: {name} from {caller})")


def register() -> None:
    """Make ``nccl_standin`` a backend name ``init_process_group`` accepts (idempotent)."""
    if NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(NAME, _create, devices=["cpu"])


def _create(store, rank, size, timeout):
    return HostTensorRejectingGroup(store, rank, size, timeout)


def _trusted_caller() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if frame.f_code.co_name in _OBJECT_COLLECTIVES or any(part in path for part in _TRUSTED):
            return True
        frame = frame.f_back
    return False


def _first_outside_torch() -> str:
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/" not in path and "nccl_standin" not in path:
            return f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return "?"


__all__ = ["NAME", "HostTensorRejectingGroup", "register", "rejected"]
