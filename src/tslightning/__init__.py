"""tslightning: exact gradient streaming (ThunderSyncRL) for agentic RL on Lightning / Fabric.

The data path, in order: sources and completion events (:mod:`tslightning.sources`) registered per logical batch
(:mod:`tslightning.batch_registry`) → the streaming module's per-source backward and exact accumulators
(:mod:`tslightning.streaming_module`, :mod:`tslightning.group_accumulator`, :mod:`tslightning.turn_accumulator`)
→ the barrier: reduce, normalize, clip, one optimizer step.
"""

from tslightning.advantages import AdvantageEstimator
from tslightning.batch_registry import BatchPlan, Objective
from tslightning.sources import (
    BatchClosed,
    GroupClosed,
    PolicyVersionError,
    SourceError,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)
from tslightning.streaming_module import OptimizerSettings, Schedule, StreamingPolicyModule, UpdateResult

__version__ = "0.1.0"

__all__ = [
    "AdvantageEstimator",
    "BatchClosed",
    "BatchPlan",
    "GroupClosed",
    "Objective",
    "OptimizerSettings",
    "PolicyVersionError",
    "Schedule",
    "SourceError",
    "StreamingPolicyModule",
    "TrajectoryClosed",
    "TrajectorySource",
    "TurnSource",
    "UpdateResult",
]
