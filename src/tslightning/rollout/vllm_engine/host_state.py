"""What running vLLM's engine inside (or beside) the learner's process does to that process, and how the ``vllm``
engine contains it: the environment its engine process starts with, the host state an in-process engine keeps while
it runs (restored on close), and the RNG and thread-count side effects of vLLM's CPU worker (undone at once).
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tslightning.distributed.rank_placement import LEARNER_RANK_VARIABLES

__all__ = ["HostState", "contain_vllm_side_effects", "engine_environment", "scoped_environment"]


def engine_environment(
    in_process: bool, cpus: Sequence[int] | None, gpus: Sequence[int] | None
) -> dict[str, str | None]:
    """Environment changes vLLM's engine process is started with (``None``: removed); none in process."""
    if in_process:
        return {}
    environment: dict[str, str | None] = dict.fromkeys(LEARNER_RANK_VARIABLES)
    if cpus is not None:
        environment["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cpus)
    if gpus is not None:
        environment["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return environment


@contextlib.contextmanager
def scoped_environment(changes: Mapping[str, str | None]) -> Iterator[None]:
    """Apply ``changes`` to ``os.environ`` while vLLM spawns its engine process (which inherits them), then undo."""
    saved = {name: os.environ.get(name) for name in changes}
    try:
        for name, value in changes.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(frozen=True)
class HostState:
    """What an in-process vLLM engine changes in the host process and keeps while it runs; restored on close."""

    environ: dict[str, str]
    excepthook: Any

    @classmethod
    def capture(cls) -> HostState:
        return cls(dict(os.environ), sys.excepthook)

    def restore(self) -> None:
        with contextlib.suppress(ImportError):
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            # Destroys the torch.distributed group vLLM started here, unfreezes the GC, clears vLLM's env cache.
            cleanup_dist_env_and_memory()
        for name in set(os.environ) - set(self.environ):
            del os.environ[name]
        os.environ.update(self.environ)
        sys.excepthook = self.excepthook


@contextlib.contextmanager
def contain_vllm_side_effects() -> Iterator[None]:
    """Undo what vLLM's in-process CPU worker does to the host process: reseeded RNGs, a disabled set_num_threads."""
    set_num_threads, python_state = torch.set_num_threads, random.getstate()
    numpy_state = _numpy_random_state()
    # This process's device only: forking every visible GPU's generator would open a CUDA context on each.
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            torch.set_num_threads = set_num_threads
            random.setstate(python_state)
            if numpy_state is not None:
                import numpy

                numpy.random.set_state(numpy_state)


def _numpy_random_state() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random.get_state()
