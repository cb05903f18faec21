"""The collectives tslightning issues itself, each over a group whose backend accepts its tensor.

Two kinds (NCCL, the GPU backend Lightning picks, rejects host tensors):

* **Control messages** — status flags, counts, publication outcomes: a few numbers on the host. They go over a gloo
  group: the default group when its backend is gloo (CPU runs), else a gloo side group over the same ranks, made once
  from the default group with its timeout.
* **Data** — the batch direction: reduced on the learner's device, over the group that serves that device: the
  default group for an accelerator (a host tensor, statistics kept in host memory, is copied to the device, reduced
  there and copied back), the gloo group on a CPU learner.

Lightning's own collectives (DDP's module sync, ``strategy.broadcast``, ``reduce_boolean_decision``) place their
tensors on the strategy's root device themselves.

A collective that fails because a rank died, hung past the timeout or closed its connection raises
:class:`CollectiveFailure`; any other error (a wrong dtype or device, a backend that cannot take the tensor) passes
through unchanged, so it is reported as what it is, not as a dead rank.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

_PEER_FAILURE_MARKERS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "aborted",
    "peer",
    "socket",
)
"""Lower-case fragments of the errors gloo and NCCL raise when a peer died, hung or hung up."""

_control_groups: dict[int, dist.ProcessGroup] = {}
_control_timeouts: dict[int, timedelta] = {}


class CollectiveFailure(RuntimeError):
    """A collective could not complete because another rank died, hung past the group's timeout or hung up."""


def distributed() -> bool:
    """Several learner ranks in an initialized default process group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def control_group(timeout: timedelta | None = None) -> dist.ProcessGroup | None:
    """The gloo group control messages use, made once: a side group of its own when the default group is not gloo or
    ``timeout`` was given; else ``None`` (the default gloo group carries them, with its timeout).

    Args:
        timeout: The control messages' own timeout, given at the first call (``fit``: ``learner.control_timeout_s``).
            Control messages include waits for other ranks' rollouts, so it is longer than the data collectives'.

    Every rank must call this at the same point the first time (any control collective does): creating a group is
    itself collective. ``fit`` calls it right after launch.
    """
    if not distributed():
        return None
    key = id(dist.distributed_c10d._get_default_group())
    if timeout is not None and key not in _control_groups:
        _control_timeouts[key] = timeout
    if key not in _control_groups:
        if dist.get_backend() == dist.Backend.GLOO and key not in _control_timeouts:
            return None
        _control_groups[key] = dist.new_group(backend=dist.Backend.GLOO, timeout=control_timeout())
    return _control_groups[key]


def control_timeout() -> timedelta | None:
    """The control messages' timeout: the one given to :func:`control_group`, else the default group's."""
    if not distributed():
        return None
    return _control_timeouts.get(id(dist.distributed_c10d._get_default_group())) or group_timeout()


def control_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """Sum a host tensor over every rank in place (over :func:`control_group`); identity on one process.

    Raises:
        CollectiveFailure: if a rank died, hung or hung up.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"control messages are host tensors; got one on {tensor.device}")
    if distributed():
        _run(lambda: _unless_a_rank_died(dist.all_reduce(tensor, dist.ReduceOp.SUM, control_group(), async_op=True)))
    return tensor


def all_reduce_sum(tensor: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Sum ``tensor`` over every rank in place, reduced on ``device`` over the default group; identity on one process.

    Args:
        tensor: The data to reduce, on any device (host statistics included).
        device: The learner's device, where the reduction runs (``None``: the tensor's own).

    Raises:
        CollectiveFailure: if a rank died, hung or hung up.
    """
    if not distributed():
        return tensor
    device = tensor.device if device is None else torch.device(device)
    group = control_group() if device.type == "cpu" else None  # None: the default group (NCCL on GPUs)
    staged = tensor if tensor.device == device else tensor.to(device, non_blocking=tensor.is_pinned())
    _run(lambda: dist.all_reduce(staged, op=dist.ReduceOp.SUM, group=group))
    if staged is not tensor:
        tensor.copy_(staged)
    return tensor


def control_all_gather(value: object) -> list[object]:
    """Every rank's ``value`` (a small picklable object), in rank order, over :func:`control_group`.

    Raises:
        CollectiveFailure: if a rank died, hung or hung up.
    """
    if not distributed():
        return [value]
    values: list[object] = [None] * dist.get_world_size()
    _run(lambda: dist.all_gather_object(values, value, group=control_group()))
    return values


def control_broadcast(value: object, src: int = 0) -> object:
    """Rank ``src``'s ``value`` (a small picklable object) on every rank, over :func:`control_group`; the other ranks'
    ``value`` is ignored. Identity on one process.

    Raises:
        CollectiveFailure: if a rank died, hung or hung up.
    """
    if not distributed():
        return value
    holder = [value if dist.get_rank() == src else None]
    _run(lambda: dist.broadcast_object_list(holder, src=src, group=control_group()))
    return holder[0]


def send_receive(
    row: torch.Tensor | None, to: int, source: int | None, n: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor | None:
    """One step of a ring exchange, taken by every rank together: send ``row`` (``(n,)``; ``None``: nothing) to rank
    ``to`` and receive ``n`` values from rank ``source`` (``None``: nothing); returns what arrived.

    An ``all_to_all_single`` whose splits are zero but for those two ranks, so every rank's call matches every
    other's (NCCL needs a step's sends and receives issued as one group, which it is) and a rank buffers one row,
    not a row for every peer. Exchanged on ``device`` (the learner's) over the group that serves it, like
    :func:`all_reduce_sum`. On one process the row is its own arrival.

    Raises:
        CollectiveFailure: if a rank died, hung or hung up.
    """
    device = torch.device(device)
    if not distributed():
        return None if source is None or row is None else row.to(device)
    group = control_group() if device.type == "cpu" else None
    world_size = dist.get_world_size()
    send = row.to(device).contiguous() if row is not None else torch.empty(0, dtype=dtype, device=device)
    incoming = torch.empty(n if source is not None else 0, dtype=dtype, device=device)
    send_splits, receive_splits = [0] * world_size, [0] * world_size
    if row is not None:
        send_splits[to] = n
    if source is not None:
        receive_splits[source] = n
    _run(lambda: dist.all_to_all_single(incoming, send, receive_splits, send_splits, group=group))
    return incoming if source is not None else None


def _unless_a_rank_died(work: dist.Work) -> None:
    """Wait for ``work``; fail at once when the failure watch heard a rank die (it would never join: a vanished node
    closes no connection, so gloo would wait for the group's timeout)."""
    from tslightning.distributed.failure_watch import current_watch

    watch, pause = current_watch(), 1e-4
    while not work.is_completed():
        dead = watch.dead() if watch is not None else {}
        if dead:
            raise CollectiveFailure(f"rank(s) {sorted(dead)} died while this rank waited for them: {dead}")
        time.sleep(pause)
        pause = min(2 * pause, 0.01)
    work.wait()


def _run(collective) -> None:
    try:
        collective()
    except RuntimeError as error:
        if _peer_failed(error):
            raise CollectiveFailure(str(error)) from error
        raise


def _peer_failed(error: RuntimeError) -> bool:
    if isinstance(error, getattr(dist, "DistNetworkError", ())) or isinstance(
        error, getattr(dist, "DistStoreError", ())
    ):
        return True
    message = str(error).lower()
    return any(marker in message for marker in _PEER_FAILURE_MARKERS)


def group_timeout() -> timedelta | None:
    """The default process group's collective timeout, where the backend exposes it (gloo, NCCL)."""
    if not distributed():
        return None
    group = dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None
