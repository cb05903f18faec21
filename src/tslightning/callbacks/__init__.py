"""Lightning callbacks for the barrier, clipping, publication, staleness and measurement (MFU, release trace); each
works under a Trainer and Fabric.

Layer: above the learner and rollout. May import ``learner``, ``rollout`` (the engine interface), ``distributed``,
``core``, ``measure`` and ``objectives``; never the loop or the commands. ``read_trace`` is re-exported from
:mod:`tslightning.measure.trace_file`.
"""

from tslightning.callbacks.batch_barrier import BatchBarrier
from tslightning.callbacks.gpu_clock_checkpoint import GPUClockCheckpoint
from tslightning.callbacks.gradient_clipping import GradientClipping
from tslightning.callbacks.mfu_monitor import MFUMonitor, UpdateMeasurement
from tslightning.callbacks.release_trace import ReleaseTraceRecorder
from tslightning.callbacks.staleness_monitor import StalenessMonitor
from tslightning.callbacks.weight_publisher import WeightPublisher
from tslightning.measure.trace_file import read_trace

__all__ = [
    "BatchBarrier",
    "GPUClockCheckpoint",
    "GradientClipping",
    "MFUMonitor",
    "ReleaseTraceRecorder",
    "StalenessMonitor",
    "UpdateMeasurement",
    "WeightPublisher",
    "read_trace",
]
