"""DeepSpeed ZeRO through Fabric on CPU learner ranks (gloo), for tests and CPU-only machines.

Fabric's :class:`~lightning.fabric.strategies.DeepSpeedStrategy` refuses any accelerator but CUDA; DeepSpeed itself
runs ZeRO stages 2 and 3 on CPU over gloo. This subclass only removes the CUDA assumptions: the environment set-up
is DDP's, device indices are not validated (CPU devices have none), the engine's device rank is the local rank,
and the process group backend defaults to gloo. On GPUs use Fabric's strategy (``strategy="deepspeed_stage_2"``).
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.fabric.utilities.seed import reset_seed
from torch.nn import Module
from torch.optim import Optimizer


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """``DeepSpeedStrategy`` on CPU devices: same arguments (``stage=2`` or ``3``), ``process_group_backend="gloo"``."""

    def __init__(self, *args: Any, process_group_backend: str | None = "gloo", **kwargs: Any) -> None:
        super().__init__(*args, process_group_backend=process_group_backend, **kwargs)

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # skips DeepSpeedStrategy's "only supported on CUDA GPUs" check

    def _setup_distributed(self) -> None:
        # DeepSpeedStrategy's version, without validating CUDA device indices.
        reset_seed()
        self._set_world_ranks()
        self._init_deepspeed_distributed()
        if not self._config_initialized:
            self._format_config()
            self._config_initialized = True

    def _initialize_engine(self, model: Module, optimizer: Optimizer | None = None, scheduler: Any = None):
        import argparse

        import deepspeed

        engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer,
            lr_scheduler=scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer, ds_scheduler
