"""tslightning: exact gradient streaming (ThunderSyncRL) for agentic RL on Lightning / Fabric.

The data path, in order: sources and completion events (:mod:`tslightning.core.sources`) registered per logical batch
(:mod:`tslightning.core.batch_registry`) → the streaming module's per-source backward and exact accumulators
(:mod:`tslightning.learner.streaming_module`, :mod:`tslightning.core.group_accumulator`,
:mod:`tslightning.core.turn_accumulator`) → the barrier: reduce, normalize, clip, one optimizer step.
"""

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.sources import (
    BatchClosed,
    GroupClosed,
    PolicyVersionError,
    SourceError,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)
from tslightning.learner.streaming_module import (
    OptimizerSettings,
    Schedule,
    ServiceRecord,
    StreamingPolicyModule,
    UpdateResult,
)
from tslightning.objectives.advantages import AdvantageEstimator

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
    "ServiceRecord",
    "SourceError",
    "StreamingPolicyModule",
    "TrajectoryClosed",
    "TrajectorySource",
    "TurnSource",
    "UpdateResult",
]
