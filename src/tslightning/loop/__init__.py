"""The training loop behind ``tslightning fit``: its typed settings (:mod:`.settings`), the training tasks
(:mod:`.task_selection`), start-up of policy, engine and teacher (:mod:`.startup`), one update under each schedule
(:mod:`.updates`), checkpoints and resume (:mod:`.resume`), the supervised warm start (:mod:`.warm_start`), recording
and replaying each rank's batches (:mod:`.batch_recording`, :mod:`.batch_replay`), and the loop itself, read top to
bottom (:mod:`.fit`).

Layer: above rollout, learner and callbacks, which it wires together; below the commands and the CLI.
"""

from tslightning.loop.fit import FitResult, fit
from tslightning.loop.settings import (
    AlgorithmSettings,
    CheckpointSettings,
    LoraSettings,
    ModelSettings,
    RolloutSettings,
)
from tslightning.loop.warm_start import WarmStartSettings

__all__ = [
    "AlgorithmSettings",
    "CheckpointSettings",
    "FitResult",
    "LoraSettings",
    "ModelSettings",
    "RolloutSettings",
    "WarmStartSettings",
    "fit",
]
