"""Where a run's parameters, gradients and statistics live, chosen once per run, and everything that depends on it.

Lightning has one strategy object per way of running a model; tslightning's learner has one *placement* per way of
placing the trained parameters, and every piece that depends on it asks the placement instead of probing tensors:
the streaming module's passes (gradient targets, folding, lock-step) and barrier (reduction, norm, writing the
clipped direction), the publisher (full weights), clipping, checkpoints (their layout), ``fit`` and ``tslightning
plan`` (what each rank holds).

=============================  ======================  ==========================  ==============================
placement (``name``)           parameters               a pass's gradient, per unit  barrier
=============================  ======================  ==========================  ==============================
``replicated`` (1 rank, DDP)   whole on every rank      folded into this rank's      all-reduce g_k, ``.grad`` = −g_k,
                                                        whole statistics             clipped by torch's clip
``deepspeed_stage_2``          whole on every rank      same                         all-reduce; a surrogate backward
                                                                                     reaches ZeRO's partitioned grads
``deepspeed_stage_3``          partitioned, gathered    same (lock-step passes)      same, under gathered parameters
                               per module in a pass
``fsdp``                       FSDP2 shards, one block  same (lock-step passes)      all-reduce; each rank writes its
                               unsharded at a time                                   DTensor shard of −c·g_k
``fsdp_sharded_statistics``    FSDP2 shards             exchanged: shard j of each   none: this rank's accumulator
                                                        unit to rank j, folded there  shard is its part of g_k
=============================  ======================  ==========================  ==============================

Every placement folds a pass's gradient *unit by unit while the backward runs*
(:class:`~tslightning.core.unit_backward.UnitBackward`): a source's gradient never exists whole on a rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from tslightning.core.contribution import Contribution
from tslightning.core.folding_queue import FoldingQueue
from tslightning.core.parameter_layout import ParameterLayout, total_norm
from tslightning.core.streaming_statistics import StreamingStatistics
from tslightning.core.unit_backward import UnitBackward
from tslightning.core.unit_folding import UnitFolder
from tslightning.distributed.collectives import all_reduce_sum, distributed
from tslightning.distributed.fsdp_gradients import gradient_leaves, write_direction
from tslightning.distributed.statistics_shards import StatisticsShards
from tslightning.distributed.zero_gradients import backward_direction, clip_coefficient, release_pass_leftovers

BeforeStep = Callable[[], None] | None


class ParameterPlacement:
    """Replicated parameters (one rank, or DDP): the base every placement refines."""

    name: ClassVar[str] = "replicated"
    """The placement, and the checkpoint layout it writes (:mod:`tslightning.callbacks.checkpoint_layout`)."""
    shards_parameters: ClassVar[bool] = False
    """Each rank holds a part of every parameter outside a pass (passes gather them: lock-step on several ranks)."""
    shards_optimizer: ClassVar[bool] = False
    """Each rank holds a part of the optimizer state."""
    shards_statistics: ClassVar[bool] = False
    """Each rank holds its shard of the streaming statistics (of every rank's sources)."""

    def __init__(self) -> None:
        self.module: Any = None
        self.units: UnitBackward | None = None
        self.folder: UnitFolder | None = None

    # ----------------------------------------------------------------- set-up
    @property
    def clips_in_module(self) -> bool:
        """Whether the barrier must clip (the gradients live in ZeRO's engine or in shards, out of a callback's
        reach); a replicated ``.grad`` can be clipped by :class:`~tslightning.callbacks.GradientClipping` instead."""
        return self.shards_optimizer or self.shards_parameters

    def bind(self, module: Any) -> None:
        """Attach to the streaming module once its strategy has set it up (idempotent).

        Raises:
            ValueError: if the module's parameters are not placed as this placement says.
        """
        self.module = module
        layout = module.layout
        self.units = self.units or UnitBackward(layout.units)
        self.folder = self.folder or UnitFolder(module.folding, max(_numel(layout, unit) for unit in layout.units))
        self.check_parameters(layout)

    def check_parameters(self, layout: ParameterLayout) -> None:
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in layout.parameters):
            raise ValueError(
                f"the {self.name} placement found sharded parameters; choose the placement of the strategy that "
                "sharded them (placement_for(learner.strategy))"
            )

    def statistics(
        self, layout: ParameterLayout, objective, estimator, eps, dtype, folding: FoldingQueue | None
    ) -> StreamingStatistics:
        """The streaming statistics this placement folds into (whole on every rank); ``folding``: the module's
        folding thread (``learner.fold_queue_depth``), or ``None``."""
        return StreamingStatistics(layout, objective, estimator, eps, dtype, folding)

    @property
    def lockstep(self) -> bool:
        """Whether passes are collectives (parameters gathered per block), so ranks serve them in lock-step."""
        return self.shards_parameters and distributed()

    # ----------------------------------------------------------------- passes
    def leaves(self) -> list[torch.Tensor]:
        """What a pass differentiates for the trainable parameters (call after its forward)."""
        return self.module.layout.parameters

    def backward(
        self,
        outputs: Sequence[torch.Tensor],
        contribution: Contribution | None,
        statistics: StreamingStatistics,
        inputs: Sequence[torch.Tensor] = (),
        grad_outputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> list[torch.Tensor]:
        """Back-propagate one pass: each unit of the parameters' gradient is folded into ``contribution``'s
        statistics as it is produced (``None``: an idle pass, nothing folded); returns the gradients of ``inputs``.
        Counts the contribution's source in its group afterwards."""
        layout = self.module.layout

        def fold(unit: int, grads: dict[int, torch.Tensor]) -> None:
            if contribution is not None and grads:
                self.folder.fold(
                    [p for s, a in statistics.terms(contribution) for p in layout.unit_pieces(s, grads, a)]
                )

        adjoints = self.units.run(outputs, self.leaves(), fold, inputs, grad_outputs, retain_graph)
        if contribution is not None:
            statistics.record(contribution)
        return adjoints

    def after_pass(self) -> None:
        """Local clean-up after each pass (ZeRO-3 releases what the pass left gathered)."""

    # ----------------------------------------------------------------- barrier
    def reduce(self, accumulator: torch.Tensor) -> torch.Tensor:
        """This rank's accumulated sum, summed over the ranks (on the learner's device, a collective)."""
        return all_reduce_sum(accumulator.clone(), self.module.layout.parameters[0].device)

    def norm(self, direction: torch.Tensor) -> float:
        """‖g_k‖, from its entries summed in float64."""
        return float(torch.linalg.vector_norm(direction, dtype=torch.float64))

    def apply_direction(
        self, direction: torch.Tensor, norm: float, max_norm: float | None, before_step: BeforeStep
    ) -> float:
        """Hand the optimizer −c·g_k (c: the clipping coefficient; optimizers descend) and run ``before_step`` (the
        callbacks) once it is in place; returns the c applied. Replicated, ``.grad`` = −g_k first, so a
        :class:`~tslightning.callbacks.GradientClipping` callback may clip it instead of the module."""
        layout = self.module.layout
        layout.write_grads(direction, scale=-1.0)
        written = float(total_norm(p.grad for p in layout.parameters))
        _run(before_step)
        grad_norm = total_norm(p.grad for p in layout.parameters)  # after any callback's clipping, as torch takes it
        applied = float(grad_norm) / written if written > 0 else 1.0  # what the callbacks left of −g_k
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(layout.parameters, max_norm, grad_norm)
            applied *= clip_coefficient(float(grad_norm), max_norm)
        return applied

    # ----------------------------------------------------------------- publication
    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """A parameter or buffer of the policy with its full value, detached (publication streams them one at a
        time, :mod:`tslightning.callbacks.published_weights`). Where parameters are sharded this is a collective:
        every rank asks for the same tensors in the same order."""
        return tensor.detach()

    def full_shape(self, tensor: torch.Tensor) -> tuple[int, ...]:
        """The shape :meth:`full_tensor` returns, gathering nothing."""
        return tuple(tensor.shape)


class ZeroPlacement(ParameterPlacement):
    """DeepSpeed ZeRO-2 (partitioned optimizer state and gradients) or ZeRO-3 (parameters partitioned too, gathered
    module by module in every pass: lock-step on several ranks). Gradients live in the engine, so the barrier reaches
    them with a surrogate backward (:mod:`tslightning.distributed.zero_gradients`) and clips in the module."""

    shards_optimizer = True

    def __init__(self, stage: int) -> None:
        if stage not in (2, 3):
            raise ValueError(f"ZeroPlacement: stage must be 2 or 3; got {stage}")
        super().__init__()
        self.stage = stage

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"deepspeed_stage_{self.stage}"

    @property
    def shards_parameters(self) -> bool:  # type: ignore[override]
        return self.stage == 3

    def check_parameters(self, layout: ParameterLayout) -> None:
        from tslightning.distributed.zero_gradients import deepspeed_fabric

        if deepspeed_fabric(self.module) is None:
            raise ValueError(
                f"the {self.name} placement needs the module set up by a Fabric DeepSpeed strategy "
                "(learner.strategy deepspeed_stage_2/3)"
            )

    def after_pass(self) -> None:
        release_pass_leftovers(self.module)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if not hasattr(tensor, "ds_id"):  # ZeRO-2, or a tensor ZeRO-3 did not partition
            return tensor.detach()
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
            return tensor.data.detach().clone()  # copied out before the partition is released

    def full_shape(self, tensor: torch.Tensor) -> tuple[int, ...]:
        return tuple(getattr(tensor, "ds_shape", None) or tensor.shape)  # ZeRO-3 keeps the full shape aside

    def apply_direction(
        self, direction: torch.Tensor, norm: float, max_norm: float | None, before_step: BeforeStep
    ) -> float:
        from tslightning.distributed.zero_gradients import deepspeed_fabric

        coefficient = clip_coefficient(norm, max_norm)
        _run(before_step)
        backward_direction(deepspeed_fabric(self.module), self.module, self.module.layout, direction, -coefficient)
        return coefficient


class FullyShardedPlacement(ParameterPlacement):
    """FSDP2 (``fully_shard``, one unit per decoder block): each rank holds its shard of every parameter and of the
    optimizer state; a pass all-gathers one block at a time (lock-step on several ranks) and differentiates the
    unsharded block parameters (:func:`~tslightning.distributed.fsdp_gradients.gradient_leaves`). Statistics whole
    on every rank; the barrier all-reduces g_k and each rank writes its shard of −c·g_k."""

    name = "fsdp"
    shards_parameters = True
    shards_optimizer = True

    def check_parameters(self, layout: ParameterLayout) -> None:
        from torch.distributed.tensor import DTensor

        if not all(isinstance(p, DTensor) for p in layout.parameters):
            raise ValueError(
                f"the {self.name} placement needs FSDP2 parameter shards (learner.strategy: fsdp) on every trainable "
                "parameter; set it up through Fabric's ModelParallelStrategy with shard_policy"
            )

    def leaves(self) -> list[torch.Tensor]:
        return gradient_leaves(self.module.policy, self.module.layout.parameters)

    def full_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        return tensor.full_tensor().detach() if isinstance(tensor, DTensor) else tensor.detach()

    def apply_direction(
        self, direction: torch.Tensor, norm: float, max_norm: float | None, before_step: BeforeStep
    ) -> float:
        coefficient = clip_coefficient(norm, max_norm)
        write_direction(self.module.layout, direction, scale=-coefficient)
        _run(before_step)
        return coefficient


class ShardedStatisticsPlacement(FullyShardedPlacement):
    """FSDP2 with sharded statistics (``learner.shard_statistics``): each rank holds its shard — FSDP2's dim-0
    chunks — of every rank's statistics; each unit of a pass's gradient is exchanged as the backward produces it
    (:mod:`tslightning.distributed.statistics_shards`), and the accumulator shard is this rank's part of g_k."""

    name = "fsdp"  # the parameters' checkpoint layout is FSDP2's; the statistics are not checkpointed
    shards_statistics = True

    def __init__(self) -> None:
        super().__init__()
        self.shards: StatisticsShards | None = None

    def statistics(
        self, layout: ParameterLayout, objective, estimator, eps, dtype, folding: FoldingQueue | None
    ) -> StreamingStatistics:
        self.shards = StatisticsShards(layout, objective, estimator, eps, dtype, folding)
        return self.shards.statistics

    def check_parameters(self, layout: ParameterLayout) -> None:
        self.shards.check_parameters()

    def bind(self, module: Any) -> None:
        super().bind(module)
        self.folder = self.shards.folder

    def backward(
        self,
        outputs: Sequence[torch.Tensor],
        contribution: Contribution | None,
        statistics: StreamingStatistics,
        inputs: Sequence[torch.Tensor] = (),
        grad_outputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> list[torch.Tensor]:
        """One lock-step pass: every rank's contribution is agreed first, then each unit is exchanged and folded as
        the backward produces it, in the fold order; a pass that fails mid-backward still completes its exchanges
        (sending zeros) so no peer waits for it (the failure is reported at the next tick)."""
        layout, shards = self.module.layout, self.shards
        contributions = shards.begin_pass(contribution)
        device = layout.parameters[0].device
        exchanged: set[int] = set()

        def fold(unit: int, grads: dict[int, torch.Tensor]) -> None:
            try:
                shards.exchange_unit(contributions, layout.units[unit], _sent(contribution, grads), device)
            finally:
                exchanged.add(unit)  # its ring steps ran (a fold that failed in between let them finish)

        try:
            adjoints = self.units.run(outputs, self.leaves(), fold, inputs, grad_outputs, retain_graph)
        except BaseException:
            for unit in self.units.order:  # complete the pass's collectives: the peers are waiting in them
                if unit not in exchanged:
                    shards.exchange_unit(contributions, layout.units[unit], _sent(contribution, {}), device, False)
            raise
        shards.end_pass(contributions)
        return adjoints

    def reduce(self, accumulator: torch.Tensor) -> torch.Tensor:
        return accumulator.clone()  # every rank's sources are already folded into every shard

    def norm(self, direction: torch.Tensor) -> float:
        return self.shards.norm(direction)

    def apply_direction(
        self, direction: torch.Tensor, norm: float, max_norm: float | None, before_step: BeforeStep
    ) -> float:
        coefficient = clip_coefficient(norm, max_norm)
        self.shards.write_grads(direction, scale=-coefficient)
        _run(before_step)
        return coefficient


def placement_for(strategy: str, shard_statistics: bool = False) -> ParameterPlacement:
    """The placement of ``learner.strategy`` (``auto``, ``ddp``, ``fsdp``, ``deepspeed_stage_2``/``_3``), with
    ``learner.shard_statistics`` under ``fsdp``."""
    if strategy == "fsdp":
        return ShardedStatisticsPlacement() if shard_statistics else FullyShardedPlacement()
    if strategy.startswith("deepspeed_stage_"):
        return ZeroPlacement(int(strategy[-1]))
    return ParameterPlacement()


def placement_of_strategy(strategy: Any) -> ParameterPlacement:
    """The placement a Fabric (or Trainer) strategy object implies, for a module set up without an explicit one."""
    from lightning.fabric import strategies as fabric
    from lightning.pytorch import strategies as trainer

    if isinstance(strategy, fabric.ModelParallelStrategy | trainer.ModelParallelStrategy):
        return FullyShardedPlacement()
    if isinstance(strategy, fabric.DeepSpeedStrategy | trainer.DeepSpeedStrategy):
        return ZeroPlacement(strategy.config["zero_optimization"]["stage"])
    return ParameterPlacement()


def placement_of(module: Any, strategy: Any) -> ParameterPlacement:
    """``module``'s placement (a :class:`~tslightning.learner.streaming_module.StreamingPolicyModule`'s, once chosen),
    else the one ``strategy`` implies: for callers outside the module, such as publication or a resume before the
    first batch."""
    return getattr(module, "placement", None) or placement_of_strategy(strategy)


def _sent(contribution: Contribution | None, grads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """What this rank sends of a unit: its gradient (zeros where absent), or nothing for an idle pass."""
    return None if contribution is None else grads


def _numel(layout: ParameterLayout, unit: Sequence[int]) -> int:
    return sum(layout.shapes[i].numel() for i in unit)


def _run(before_step: BeforeStep) -> None:
    if before_step is not None:
        before_step()
