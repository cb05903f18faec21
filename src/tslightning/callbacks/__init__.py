"""Lightning callbacks for the barrier, clipping, publication, staleness and measurement (MFU, release trace) and
GPU-clock checkpoints; each works on any LightningModule, under a Trainer and under Fabric (what a callback reads of a
module and how it finds an update: :mod:`tslightning.callbacks.update_callback`).

Layer: above the learner and rollout. May import ``learner``, ``rollout`` (the engine interface), ``distributed``,
``core``, ``measure`` and ``objectives``; never the loop or the commands. ``read_trace`` is re-exported from
:mod:`tslightning.measure.trace_file`; ``log_update_metrics`` and ``write_update_row`` from
:mod:`tslightning.learner.update_log`.
"""

from tslightning.callbacks.batch_barrier import BatchBarrier
from tslightning.callbacks.checkpoint_state import CheckpointError, restore_checkpoint
from tslightning.callbacks.gpu_clock_checkpoint import GPUClockCheckpoint
from tslightning.callbacks.gradient_clipping import GradientClipping
from tslightning.callbacks.mfu_monitor import MFUMonitor, UpdateMeasurement
from tslightning.callbacks.release_trace import ReleaseTraceRecorder
from tslightning.callbacks.staleness_monitor import StalenessMonitor
from tslightning.callbacks.update_callback import Publication, UpdateCallback
from tslightning.callbacks.weight_publisher import WeightPublisher
from tslightning.learner.update_log import log_update_metrics, write_update_row
from tslightning.measure.trace_file import read_trace

__all__ = [
    "BatchBarrier",
    "CheckpointError",
    "GPUClockCheckpoint",
    "GradientClipping",
    "MFUMonitor",
    "Publication",
    "ReleaseTraceRecorder",
    "StalenessMonitor",
    "UpdateCallback",
    "UpdateMeasurement",
    "WeightPublisher",
    "log_update_metrics",
    "read_trace",
    "restore_checkpoint",
    "write_update_row",
]
