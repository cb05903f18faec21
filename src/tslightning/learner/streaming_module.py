"""The streaming GRPO/OPD LightningModule: per-source backward, exact accumulators, one step per logical batch.

Data path (Algorithm 1): a :class:`~tslightning.core.batch_registry.BatchPlan` opens update k; sources and completion
events arrive in readiness order through :meth:`StreamingPolicyModule.ingest`; under the ``thundersync`` schedule
each source's backward runs at once and is folded into exact running statistics (Eq. 7 for GRPO, Eq. 9's
numerator for OPD); :meth:`StreamingPolicyModule.barrier` then reduces across ranks, normalizes, clips the global
norm and takes exactly one AdamW step (Eq. 3). Under the ``sync`` schedule the same module stores the sources and
computes the whole batch at the barrier with one padded, batched objective — the batch-synchronous baseline.

All gradients are taken at the fixed snapshot θ_k: nothing mutates parameters between :meth:`begin_batch` and the
barrier. Context gradients are exact because every source recomputes its full causal context (prompt and earlier
turns); learner cost per source is one forward and backward over all of ``token_ids``. With
``context_backward="boundary"`` (thundersync) each context runs once instead and later sources' boundary adjoints
are back-propagated through it when its group or trajectory closes (App. I,
:mod:`tslightning.learner.boundary_adjoint`).

On several ranks with partitioned parameters (DeepSpeed ZeRO-3, FSDP2) every per-source pass gathers each layer in a
collective, so learner work is queued and served in lock-step ticks across ranks
(:mod:`tslightning.distributed.lockstep`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import lightning as L
import torch

from tslightning.core.batch_registry import BatchPlan, BatchRegistry, Objective
from tslightning.core.contribution import BATCH, Contribution
from tslightning.core.folding_queue import FoldingQueue
from tslightning.core.gradient_units import gradient_units
from tslightning.core.group_accumulator import GroupReduction
from tslightning.core.parameter_layout import ParameterLayout
from tslightning.core.sources import (
    GroupClosed,
    PolicyVersionError,
    Source,
    SourceError,
    StreamItem,
    TrajectoryClosed,
    TrajectorySource,
    TurnSource,
)
from tslightning.distributed.collectives import control_all_reduce
from tslightning.distributed.lockstep import LockstepTicks
from tslightning.distributed.parameter_placement import (
    ParameterPlacement,
    ShardedStatisticsPlacement,
    placement_of_strategy,
)
from tslightning.distributed.rank_failure import agree_to_step, reported_to_ranks
from tslightning.distributed.statistics_shards import StatisticsShards
from tslightning.learner.batched_serving import BatchedServing
from tslightning.learner.boundary_adjoint import ContextBackward, SharedPromptBackward, TurnBoundaryBackward
from tslightning.learner.group_admission import GroupAdmission
from tslightning.learner.precision import pass_context
from tslightning.learner.settings import OptimizerSettings, Schedule
from tslightning.learner.spread_groups import SpreadGroups, spread_groups
from tslightning.learner.update_result import ServiceRecord, UpdateResult, UpdateTimings
from tslightning.learner.update_stream import UpdateStreamHooks, check_plan, check_token_range
from tslightning.measure.device_clock import synchronized_clock
from tslightning.objectives.advantages import GRPO_EPSILON, AdvantageEstimator
from tslightning.objectives.scored_logprobs import DEFAULT_CHUNK_ROWS, checked_chunk_tokens, scored_logprobs


class StreamingPolicyModule(BatchedServing, UpdateStreamHooks, L.LightningModule):
    """Exact gradient streaming for GRPO and OPD on any causal LM (full fine-tuning or a peft LoRA model).

    Args:
        policy: A causal LM (``transformers`` model, optionally wrapped by peft); its parameters with
            ``requires_grad=True`` are trained and sized the statistics.
        objective: ``grpo`` (Eqs. 4-7) or ``opd`` (Eqs. 8-9).
        schedule: ``thundersync`` streams each source's backward at ingestion; ``sync`` runs all learner work
            at the barrier (the batch-synchronous baseline).
        advantage: Group-relative advantage for GRPO (see :mod:`tslightning.objectives.advantages`).
        advantage_epsilon: ε of Eq. 6.
        max_grad_norm: Global-norm clipping threshold applied to the batch direction (Table 5: 1.0); ``None`` when
            a :class:`~tslightning.callbacks.GradientClipping` callback clips instead.
        group_admission_cap: Cap k on GRPO groups holding statistics (App. D.3), per rank, or over all ranks for
            groups spread under ``shard_statistics`` (:mod:`tslightning.learner.spread_groups`); ``None``: no cap.
        optimizer: AdamW settings used by :meth:`configure_optimizers`.
        accumulator_dtype: dtype of the statistics; default FP32, or float64 for a float64 policy.
        micro_batch_size: Most sequences per padded learner pass: the ``sync`` schedule's micro-batches (sorted by
            length, so a micro-batch pads little), and under ``thundersync`` the sources ready at once
            (:meth:`ingest_ready`, :mod:`tslightning.learner.batched_serving`); 1: one sequence per pass.
        backlog_tokens: Most padded tokens (rows × the longest row) of a ``thundersync`` backlog pass; ``None``: no
            bound but ``micro_batch_size``. ``fit`` gives the context limit: a backlog pass then holds no more
            activations than one pass of the longest sequence.
        max_policy_lag: How many versions a batch's sampling policy may trail the learner's θ_k: 0 for the
            zero-staleness schedules; 1 for one-step-off ``async`` (sampled from θ_{k−1}, evaluated at θ_k without
            importance correction, App. D.4).
        context_backward: How a source's gradient reaches its causal context under ``thundersync``: ``recompute``
            (each source runs its whole ``token_ids``) or ``boundary`` (a GRPO group's prompt and an OPD
            trajectory's earlier turns run once; boundary adjoints are back-propagated when the group or trajectory
            closes, App. I). ``sync`` is the batch-synchronous recompute baseline and accepts only ``recompute``.
        statistics_device: Where G1/G2 and the batch accumulator live: ``host`` memory (page-locked on CUDA; each
            gradient unit staged through page-locked buffers, :mod:`tslightning.core.unit_folding`) or the policy's
            ``device`` (no copy; costs (2k+1) parameter-sized vectors, or shards of them, there).
        shard_statistics: Under FSDP2: a rank holds its shard of the statistics (:attr:`last_direction` too;
            ``shards.gather`` collects it), :mod:`tslightning.distributed.statistics_shards`. Shorthand for
            ``placement=ShardedStatisticsPlacement()``.
        fold_queue_depth: Gradient units pending for the background fold (:mod:`tslightning.core.folding_queue`); 0
            folds on the learner thread.
        placement: Where parameters, gradients and statistics live (:mod:`tslightning.distributed.parameter_placement`);
            ``None``: that of the strategy that sets the module up, chosen at the first batch.
        logprob_chunk_tokens: Most rows of logits a pass's output head holds at a time; no pass builds T×V logits
            (:mod:`tslightning.objectives.chunked_head`).
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        objective: Objective = Objective.GRPO,
        schedule: Schedule = Schedule.THUNDERSYNC,
        advantage: AdvantageEstimator = AdvantageEstimator.GRPO,
        advantage_epsilon: float = GRPO_EPSILON,
        max_grad_norm: float | None = 1.0,
        group_admission_cap: int | None = None,
        optimizer: OptimizerSettings | None = None,
        accumulator_dtype: torch.dtype | None = None,
        micro_batch_size: int = 8,
        backlog_tokens: int | None = None,
        max_policy_lag: int = 0,
        context_backward: ContextBackward = ContextBackward.RECOMPUTE,
        statistics_device: str = "host",
        shard_statistics: bool = False,
        fold_queue_depth: int = 0,
        placement: ParameterPlacement | None = None,
        logprob_chunk_tokens: int = DEFAULT_CHUNK_ROWS,
    ) -> None:
        super().__init__()
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be > 0 or None (Table 5 uses 1.0); got {max_grad_norm}")
        if max_policy_lag < 0:
            raise ValueError(f"max_policy_lag must be >= 0; got {max_policy_lag}")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1; got {micro_batch_size}")
        self.automatic_optimization = False
        self.policy = policy
        self.objective = Objective(objective)
        self.schedule = Schedule(schedule)
        self.advantage = AdvantageEstimator(advantage)
        self.advantage_epsilon = advantage_epsilon
        self.max_grad_norm = max_grad_norm
        self.optimizer_settings = optimizer or OptimizerSettings()
        self.micro_batch_size = micro_batch_size
        self.backlog_tokens = backlog_tokens
        self.max_policy_lag = max_policy_lag
        self.logprob_chunk_tokens = checked_chunk_tokens(logprob_chunk_tokens)
        self.policy_version = 0
        self.num_optimizer_steps = 0
        self.layout = ParameterLayout(policy.parameters(), statistics_device)
        self.layout.units = gradient_units(policy, self.layout.parameters)
        dtype = accumulator_dtype or torch.promote_types(self.layout.parameters[0].dtype, torch.float32)
        self.context_backward = ContextBackward(context_backward)
        if shard_statistics and placement is None:
            placement = ShardedStatisticsPlacement()
        if (
            placement is not None
            and placement.shards_statistics
            and self.context_backward is not ContextBackward.RECOMPUTE
        ):
            raise ValueError(
                "shard_statistics folds each pass at its lock-step exchange, which needs context_backward='recompute' "
                f"(got {self.context_backward.value!r}); set shard_statistics false"
            )
        self.placement = placement
        """Where parameters, gradients and statistics live (``None`` until the first batch picks the strategy's)."""
        self.folding = FoldingQueue(fold_queue_depth) if fold_queue_depth else None
        self.statistics = (placement or ParameterPlacement()).statistics(
            self.layout, self.objective, self.advantage, advantage_epsilon, dtype, self.folding
        )
        """The objective's streaming statistics (this rank's shard of them under sharded statistics)."""
        self.groups = self.statistics.groups
        """GRPO's open groups' G1'/G2 and the batch accumulator (``None`` for OPD)."""
        self.turns = self.statistics.turns
        """OPD's Σ_j g_j and N_k (``None`` for GRPO)."""
        if self.context_backward is ContextBackward.BOUNDARY and self.schedule is not Schedule.THUNDERSYNC:
            raise ValueError(
                f"context_backward='boundary' streams context adjoints under the thundersync schedule; the "
                f"{self.schedule.value!r} schedule is the recompute baseline (use context_backward='recompute')"
            )
        boundary = self.context_backward is ContextBackward.BOUNDARY
        passes = (policy, self.layout.parameters, dtype, self._backward, self.logprob_chunk_tokens)
        self.shared_prompts = SharedPromptBackward(*passes) if boundary else None
        """GRPO shared-prefix backward (``context_backward="boundary"``): prompt graphs of open groups."""
        self.turn_boundaries = TurnBoundaryBackward(*passes) if boundary else None
        """OPD turn-boundary backward (``context_backward="boundary"``): turn graphs of open trajectories."""
        self.admission: GroupAdmission[Source | GroupClosed] = GroupAdmission(group_admission_cap)
        self.spread: SpreadGroups | None = None
        """The open batch's GRPO groups spread over ranks (sharded statistics), or ``None``: whole groups."""
        self.last_direction: torch.Tensor | None = None
        self.last_update: UpdateResult | None = None
        self._registry: BatchRegistry | None = None
        self._held_sources: list[Source] = []  # sync schedule: sources waiting for the barrier
        self._rewards: dict[str, dict[int, float]] = {}  # GRPO: each group's rewards so far, by trajectory index
        self._backlog: list[Source | GroupClosed] | None = None  # while ingest_ready admits a backlog
        self._reductions: list[GroupReduction] = []
        self._num_sources = 0
        self._num_scored_tokens = 0
        self.service_log: list[ServiceRecord] = []
        """Per-source service times of the current (or last finished) update."""
        self.lockstep: LockstepTicks | None = None
        """Lock-step serving of the open update (several ranks, ZeRO-3 or FSDP2 sharded parameters), or ``None``."""
        self.update_timings: UpdateTimings = {}
        """Seconds spent per phase of the current update (:class:`UpdateTimings`: ``learner_service_s``,
        ``barrier_s``; loop and callbacks add ``rollout_wait_s``, ``publication_s``, ...)."""

    # ----------------------------------------------------------------- the stream
    @property
    def registry(self) -> BatchRegistry | None:
        """Registration and completion state of the open logical batch (``None`` between batches)."""
        return self._registry

    def begin_batch(self, plan: BatchPlan) -> None:
        """Register logical batch B_k (Algorithm 1, line 3) at the current snapshot θ_k."""
        if self._registry is not None:
            raise SourceError(f"BatchPlan for version {plan.policy_version} while batch {self.policy_version} is open")
        lag = self.policy_version - plan.allowed_versions.start
        if not 0 <= lag <= self.max_policy_lag or plan.policy_version > self.policy_version:
            raise PolicyVersionError(
                f"BatchPlan.policy_version is {plan.policy_version} but the learner holds θ_{self.policy_version} "
                f"and accepts a policy lag of at most {self.max_policy_lag}"
                + (" (zero-staleness schedule)" if self.max_policy_lag == 0 else "")
            )
        check_plan(plan, self.objective, self.advantage)
        self._bind_placement()  # checks the parameters are placed as the placement says, before anything opens
        self.spread = spread_groups(plan, self.shards, self.admission.cap, self._serve_trajectory)
        self.lockstep = self._lockstep_ticks()
        self.statistics.reset()  # (re)places the statistics: the policy may have moved to its device since
        self._registry = BatchRegistry(plan)
        self.service_log = []
        self.update_timings = UpdateTimings(learner_service_s=0.0)
        for boundary in (self.shared_prompts, self.turn_boundaries):
            if boundary is not None:
                boundary.reset()  # its pass ledger, like service_log, describes the last update until now

    def ingest(self, item: StreamItem | BatchPlan) -> None:
        """Accept one ready source or completion event; under ``thundersync`` its learner work runs now.

        A rejected item raises :class:`SourceError` before any state changes.
        """
        if isinstance(item, BatchPlan):
            self.begin_batch(item)
            return
        registry = self._require_registry()
        registry.check(item)
        if isinstance(item, TrajectorySource | TurnSource):
            check_token_range(self.policy, item)
        ready_turns = [item] if isinstance(item, TurnSource) else []
        if isinstance(item, TrajectorySource) and self.shared_prompts is not None:
            self.shared_prompts.admit(item)  # refuses a trajectory outside its group's prompt
        elif isinstance(item, TurnSource) and self.turn_boundaries is not None:
            ready_turns = self.turn_boundaries.admit(item)  # turn j runs after turn j−1, whose states it continues
        registry.record(item)
        if isinstance(item, TrajectorySource | TurnSource):
            self._num_sources += 1
            self._num_scored_tokens += item.num_scored
        if isinstance(item, TrajectorySource):
            self._rewards.setdefault(item.group_id, {})[item.trajectory_index] = item.reward
        if self.schedule is Schedule.SYNC:
            if isinstance(item, TrajectorySource | TurnSource):
                self._held_sources.append(item)  # the batch-synchronous learner starts at the barrier
        elif isinstance(item, TurnSource):
            for turn in ready_turns:
                if not self._defer(turn):
                    self._serve([turn], lambda turn=turn: self._fold_turn(turn))
        elif isinstance(item, TrajectoryClosed) and self.turn_boundaries is not None:
            self._serve([], lambda: self._replay_turn_adjoints(item))
        elif isinstance(item, TrajectorySource) or (isinstance(item, GroupClosed) and self.objective is Objective.GRPO):
            self._admit_grpo(item)
        if self.lockstep is not None:
            self.lockstep.serve(self.policy_version)  # runs queued work in step with the other ranks

    def _admit_grpo(self, item: TrajectorySource | GroupClosed) -> None:
        """Run GRPO work in readiness order, holding back groups beyond the admission cap (App. D.3)."""
        if self.spread is not None:
            return self.spread.offer(item)  # closes follow the global count
        work = deque(self.admission.offer(item.group_id, item))
        while work:
            admitted = work.popleft()
            if self._defer(admitted):  # ingest_ready serves it with the rest of the backlog
                continue
            if isinstance(admitted, GroupClosed):
                work.extend(self._close_group(admitted))
            else:
                self._serve_trajectory(admitted)

    def _close_group(self, closed: GroupClosed) -> list[Source | GroupClosed]:
        """Reduce a closed group into the batch accumulator (its queued folds first); returns the work of the groups
        the admission cap releases now."""
        if self.lockstep is not None:  # admitted with its sources (a cap released it): fold them first
            self.lockstep.flush(self.policy_version)
        self._reductions.append((self.shards or self.groups).close(closed.group_id))  # drains the folds
        if self.shared_prompts is not None:
            self._serve([], lambda reduction=self._reductions[-1]: self._fold_prompt(reduction))
        return self.admission.release(closed.group_id)

    def barrier(self, optimizer: torch.optim.Optimizer, before_step: Callable[[], None] | None = None) -> UpdateResult:
        """The zero-stale optimizer barrier (Eq. 3): reduce, normalize, clip, exactly one step; θ_k → θ_{k+1}.

        Reading the update: afterwards :attr:`last_direction` holds g_k — the *ascent* direction of the objective
        (Eq. 7 / Eq. 9), reduced over ranks, normalized, before clipping, flat in :attr:`layout` order —
        :meth:`named_direction` gives it per parameter name, and :attr:`last_update` the norm and clip coefficient
        c. The optimizer is handed ``.grad = −c · g_k`` (optimizers descend), so SGD(lr) moves θ by ``+lr · c · g_k``.

        Args:
            optimizer: The optimizer over :attr:`layout` ``.parameters`` (a Fabric- or Lightning-wrapped one works).
            before_step: Runs once the batch direction is in ``.grad`` and before clipping and the step; a Fabric
                loop calls its ``on_before_optimizer_step`` callbacks here (a Trainer's LightningOptimizer calls
                them inside ``step``).

        Raises:
            SourceError: if any registered trajectory, group or the batch is still open.
            FloatingPointError: if the batch direction is not finite (no step is taken).
            RankFailureError: (several ranks) if any rank's local work failed or a rank did not reach the barrier
                within the process group's timeout; no rank steps.
        """
        registry = self._require_registry()
        barrier_start = synchronized_clock(self.layout.parameters[0].device)
        with reported_to_ranks(self.policy_version):  # a local failure is agreed on: no rank waits, none steps
            registry.require_complete()
            self._finish_learner_work(registry.plan)
        agree_to_step(self.policy_version)
        direction, num_tokens = self._reduced_direction()
        norm = self.placement.norm(direction)
        if not math.isfinite(norm):
            raise FloatingPointError(
                f"batch direction of version {self.policy_version} is not finite; refusing to step"
            )
        coefficient = self.placement.apply_direction(direction, norm, self.max_grad_norm, before_step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        now = synchronized_clock(self.layout.parameters[0].device)
        self.update_timings["barrier_s"] = now - barrier_start - self.update_timings.get("sync_s", 0.0)
        result = UpdateResult(
            policy_version=self.policy_version + 1,
            direction_norm=norm,
            clip_coefficient=coefficient,
            num_sources=self._num_sources,
            num_scored_tokens=num_tokens,
            groups=list(self._reductions),
            peak_held_numel=self.statistics.peak_held_numel,
        )
        self.last_direction = direction
        self.last_update = result
        self.policy_version += 1
        self.num_optimizer_steps += 1
        self._reset_batch()
        return result

    def _finish_learner_work(self, plan: BatchPlan) -> None:
        """Everything of update k's learner work still outstanding at the barrier: the queued folds, the sync
        schedule's whole batch, the other ranks' lock-step passes, the spread groups' reductions."""
        if self.folding is not None:
            self.folding.drain()  # a fold's error fails the update (on every rank)
        if self.schedule is Schedule.SYNC:
            self._compute_sync_direction(plan)
            self.update_timings["sync_s"] = self.update_timings["learner_service_s"]
        if self.lockstep is not None:
            self.lockstep.drain(self.policy_version)
        if self.spread is not None and self.schedule is not Schedule.SYNC:
            self._reductions = self.spread.reductions(self.shards)

    # ----------------------------------------------------------------- per-source learner work (thundersync)
    def _serve_trajectory(self, source: TrajectorySource) -> None:
        """Queue a trajectory's learner work: one pass per causal sequence (one for the built-in loop's sources), the
        last of which counts the source in its group."""
        last = len(source.segments)
        for index in range(last + 1):
            work = lambda index=index: self._fold_trajectory(source, index)  # noqa: E731
            self._serve([source] if index == last else [], work)

    def _fold_trajectory(self, source: TrajectorySource, sequence: int = 0) -> None:
        """H_i = ∇ S_i at θ_k with w = 1/(P·L_i) (Eq. 4, App. D.1) — of one of its sequences, whose gradients add up
        to H_i — folded unit by unit into its group's G1/G2 (Eq. 7) as the backward produces it."""
        plan = self._registry.plan
        completes = sequence == len(source.segments)
        contribution = Contribution(source.group_id, plan.group_sizes[source.group_id], source.reward, completes)
        weight = 1.0 / (plan.num_prompts * source.num_scored)
        if self.shared_prompts is not None:  # the continuation's part; the prompt's follows at group close
            self.shared_prompts.source_gradient(source, weight, contribution)
            return
        token_ids, scored_mask = source.sequences[sequence]
        logp = scored_logprobs(self.policy, token_ids, scored_mask, chunk_tokens=self.logprob_chunk_tokens)
        self._backward([logp.sum() * weight], contribution)

    def _fold_prompt(self, reduction: GroupReduction) -> None:
        """The prompt part of a closed group's g_G, one backward of its combined boundary adjoint (App. I)."""
        self.shared_prompts.close_group(reduction)  # folded into the batch accumulator (nothing for a uniform group)

    def _fold_turn(self, source: TurnSource) -> None:
        """g_j = Σ_t A_{j,t} ∇ log π_θ(a_{j,t}|h_{j,t}) with A detached (Eq. 8); unnormalized until the barrier."""
        if self.turn_boundaries is not None:  # the turn's own tokens; earlier turns' part follows at trajectory close
            self.turn_boundaries.turn_gradient(source)
        else:
            logp = scored_logprobs(self.policy, source.token_ids, source.scored_mask, self.logprob_chunk_tokens)
            advantage = source.teacher_logprobs.to(logp) - logp.detach()
            self._backward([(advantage * logp).sum()], BATCH)
        self.turns.count(source.num_scored)

    def _replay_turn_adjoints(self, closed: TrajectoryClosed) -> None:
        """A closed trajectory's deferred context gradient: boundary adjoints replayed through earlier turns."""
        self.turn_boundaries.close_trajectory(closed.group_id, closed.trajectory_index)

    def _backward(
        self,
        outputs: list[torch.Tensor],
        contribution: Contribution | None,
        inputs: list[torch.Tensor] = (),
        grad_outputs: list[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> list[torch.Tensor]:
        """One pass's backward through the placement: the parameters' gradient is folded into ``contribution``'s
        statistics unit by unit; returns the gradients of ``inputs`` (boundary adjoints)."""
        return self.placement.backward(outputs, contribution, self.statistics, inputs, grad_outputs, retain_graph)

    def _serve(self, sources: list[Source], work: Callable[[], None]) -> None:
        """Run learner work for ``sources`` — now, or at its lock-step tick — and record its service interval."""
        if self.lockstep is not None:
            self.lockstep.submit(lambda: self._timed(sources, work))
        else:
            self._timed(sources, work)

    def _idle_pass(self) -> None:
        """A lock-step tick's pass for a rank with no queued work: the collectives of one forward and backward (and,
        with sharded statistics, of every unit's exchange, sending nothing)."""
        tokens = torch.zeros(2, dtype=torch.long)
        logp = scored_logprobs(self.policy, tokens, torch.tensor([False, True]))
        self._backward([logp.sum()], None)  # nothing is folded
        self.placement.after_pass()

    def _lockstep_ticks(self) -> LockstepTicks | None:
        if not self.placement.lockstep:
            return None
        if self.context_backward is not ContextBackward.RECOMPUTE:
            raise ValueError(
                "context_backward='boundary' runs a different number of policy passes per source than other ranks, "
                "which lock-step parameter gathers (ZeRO-3, FSDP) cannot pair up; use context_backward='recompute'"
            )
        return LockstepTicks(self._idle_pass)

    def _timed(self, sources: list[Source], work: Callable[[], None]) -> None:
        """Run learner work for ``sources`` and record its service interval (release trace, App. B)."""
        start = synchronized_clock(self.layout.parameters[0].device)
        with pass_context(self):
            work()
        self.placement.after_pass()  # ZeRO-3: release what the pass left gathered
        end = synchronized_clock(self.layout.parameters[0].device)
        self.update_timings["learner_service_s"] = self.update_timings.get("learner_service_s", 0.0) + end - start
        self.service_log.extend(ServiceRecord.served(source, start, end) for source in sources)

    # ----------------------------------------------------------------- barrier pieces
    def _reduced_direction(self) -> tuple[torch.Tensor, int]:
        """Cross-rank sum, then the objective's normalization: GRPO Σ_G g_G; OPD Σ_j g_j / N_k (Eq. 9)."""
        direction = self.placement.reduce(self.statistics.accumulator)
        if self.objective is Objective.GRPO:
            return direction, self._num_scored_tokens
        count = int(control_all_reduce(torch.tensor([self.turns.num_tokens], dtype=torch.float64)).item())
        if count == 0:
            raise SourceError("OPD barrier with zero scored tokens across all ranks; the batch has no turn sources")
        return direction / count, count

    def _reset_batch(self) -> None:
        self._registry = None
        self.lockstep = None
        self._held_sources = []
        self._rewards = {}
        self._reductions = []
        self._num_sources = 0
        self._num_scored_tokens = 0
        self.statistics.reset()
        self.admission.reset()

    def _require_registry(self) -> BatchRegistry:
        if self._registry is None:
            raise SourceError(
                f"no logical batch is open at version {self.policy_version}; ingest a BatchPlan before its sources"
            )
        return self._registry

    def _bind_placement(self) -> None:
        """Choose the placement once (the strategy's, unless one was given) and attach it to this module."""
        if self.placement is None:
            host = getattr(self, "_fabric", None) or getattr(self, "_trainer", None)
            self.placement = placement_of_strategy(host.strategy if host is not None else None)
        self.placement.bind(self)

    @property
    def shards(self) -> StatisticsShards | None:
        """This rank's shard of the statistics (``shard_statistics``), or ``None``: whole statistics."""
        return getattr(self.placement, "shards", None)
