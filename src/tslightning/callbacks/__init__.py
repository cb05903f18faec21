"""Lightning callbacks for the barrier, clipping, publication, staleness and measurement (MFU, release trace); each
works under a Trainer and Fabric."""

from tslightning.callbacks.batch_barrier import BatchBarrier
from tslightning.callbacks.gpu_clock_checkpoint import GPUClockCheckpoint
from tslightning.callbacks.gradient_clipping import GradientClipping
from tslightning.callbacks.mfu_monitor import MFUMonitor, UpdateMeasurement
from tslightning.callbacks.release_trace import ReleaseTraceRecorder, read_trace
from tslightning.callbacks.staleness_monitor import StalenessMonitor
from tslightning.callbacks.weight_publisher import WeightPublisher

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
