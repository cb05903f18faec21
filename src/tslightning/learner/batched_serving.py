"""Padded passes over several sources (:mod:`tslightning.learner.batched_passes`): the ``sync`` schedule's
micro-batches at the barrier, and under ``thundersync`` a backlog served in one pass — the streaming module takes
every stream item ready at once (:meth:`BatchedServing.ingest_ready`) and serves the sources among them as padded
passes of up to ``micro_batch_size`` sequences instead of one pass per source.

It is work-conserving: nothing waits for a backlog to form. The loop hands over what is ready when the learner
becomes free (one item when only one is: served alone, at once, Eq. 16's premise); items that arrived while a pass ran
form the next backlog. The update is the same: a pass's weights are those the per-source passes would have used
(final advantages where a group's m rewards are known, else the group's running sums, Eq. 7), so the barrier sees the
same g_k up to floating-point summation order.

Served per source as before: the ``boundary`` context backward (its passes continue cached context states), sharded
statistics (a source is counted on every rank through its pass's exchange), and ``micro_batch_size`` 1.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tslightning.core.batch_registry import BatchPlan, Objective
from tslightning.core.contribution import BATCH, Contribution
from tslightning.core.sources import GroupClosed, Source, StreamItem, TrajectorySource, TurnSource
from tslightning.learner.batched_passes import BatchedPass, backlog_passes, turn_passes
from tslightning.learner.settings import Schedule
from tslightning.learner.spread_groups import global_rewards
from tslightning.learner.sync_direction import batch_objective, micro_batches, source_key, trajectory_coefficients


class BatchedServing:
    """The streaming module's padded passes: ``sync``'s micro-batches and ``thundersync``'s backlogs.

    Mixed into :class:`~tslightning.learner.streaming_module.StreamingPolicyModule`, whose ``ingest``, ``schedule``,
    ``objective``, ``micro_batch_size``, ``backlog_tokens``, ``context_backward``, ``spread``, ``groups``, ``turns``,
    ``statistics``, ``admission``, ``advantage``, ``advantage_epsilon``, ``registry``, ``shards``, ``lockstep``,
    ``_serve``, ``_backward``, ``_close_group``, ``_held_sources``, ``_reductions`` and ``_rewards`` it uses; its
    ``_backlog`` is ``None`` except while a backlog is being admitted.
    """

    _backlog: list[Source | GroupClosed] | None

    def ingest_ready(self, items: Sequence[StreamItem | BatchPlan]) -> None:
        """Accept the items ready now, in readiness order, as :meth:`ingest` accepts each; under ``thundersync`` their
        sources' learner work runs as padded passes of at most ``micro_batch_size`` sequences, then the group closes
        among them. A rejected item raises :class:`SourceError` once the items before it were served."""
        sources = sum(isinstance(item, TrajectorySource | TurnSource) for item in items)
        if sources < 2 or not self.serves_backlogs:
            for item in items:
                self.ingest(item)
            return
        self._backlog = []
        try:
            for item in items:
                self.ingest(item)  # admits; the learner work is deferred into self._backlog
        finally:
            backlog, self._backlog = self._backlog, None
            self._serve_backlog(backlog)

    @property
    def serves_backlogs(self) -> bool:
        """Whether several ready sources are served as one padded pass (``thundersync`` with ``micro_batch_size`` >
        1, the recompute context backward and whole statistics on this rank)."""
        return (
            self.schedule is Schedule.THUNDERSYNC
            and self.micro_batch_size > 1
            and self.context_backward.value == "recompute"
            and self.spread is None
            and self.shards is None  # sharded statistics count each source on every rank, in its pass's exchange
        )

    def _defer(self, work: Source | GroupClosed) -> bool:
        """Keep ``work`` for the backlog being admitted (``True``), or ``False``: none is, serve it now."""
        if self._backlog is None:
            return False
        self._backlog.append(work)
        return True

    def _serve_backlog(self, backlog: list[Source | GroupClosed]) -> None:
        """The backlog's passes, then its group closes in order; groups a close releases from the admission cap are
        served the same way."""
        while backlog:
            sources = [work for work in backlog if not isinstance(work, GroupClosed)]
            for batched in self._backlog_passes(sources):
                self._serve(batched.rows, lambda batched=batched: self._batched_pass(batched))
            if self.lockstep is not None:
                self.lockstep.serve(self.policy_version)  # the passes run in step with the other ranks
            released: deque = deque()
            for closed in (work for work in backlog if isinstance(work, GroupClosed)):
                released.extend(self._close_group(closed))
            backlog = list(released)

    def _backlog_passes(self, sources: list[Source]) -> list[BatchedPass]:
        if self.objective is Objective.OPD:
            return turn_passes(sources, self.micro_batch_size, self.backlog_tokens)
        plan = self.registry.plan
        known = {
            group: rewards
            for group in {s.group_id for s in sources}
            if len(rewards := self._rewards.get(group, {})) == plan.group_sizes[group]
        }
        size, tokens = self.micro_batch_size, self.backlog_tokens
        return backlog_passes(sources, plan, known, self.advantage, self.advantage_epsilon, size, tokens)

    def _batched_pass(self, batched: BatchedPass) -> None:
        """One padded pass's forward and backward, folded where it belongs; then its sources are counted."""
        objective = batch_objective(
            self.policy, self.objective, batched.rows, batched.weights, self.logprob_chunk_tokens
        )
        self._backward([objective], batched.contribution)
        for source in batched.counted:
            self.statistics.record(Contribution(source.group_id, batched.contribution.group_size, source.reward))
        size = self.registry.plan.group_sizes if batched.direct else {}
        for source in batched.direct:
            self.groups.record_direct(source.group_id, size[source.group_id], source.reward)
        if self.turns is not None:
            self.turns.count(sum(row.num_scored for row in batched.rows))

    def _compute_sync_direction(self, plan: BatchPlan) -> None:
        """All learner work after the batch closed: batch-form advantages, padded micro-batches, one sum."""
        if self.shards is None:  # sharded, peers' shards may have arrived already: the batch's reset was at its start
            self.statistics.reset()  # recomputed from scratch, so a barrier retried after an error never double-counts
        self._reductions = []
        self.service_log = []
        sources = sorted(self._held_sources, key=source_key)
        coefficients = [1.0] * len(sources)
        if self.objective is Objective.GRPO:
            rewards = None if self.spread is None else global_rewards(sources, self.lockstep, self.policy_version)
            coefficients, self._reductions = trajectory_coefficients(
                sources, plan, self.advantage, self.advantage_epsilon, rewards
            )
        for rows, weights in micro_batches(sources, coefficients, self.micro_batch_size):
            batched = BatchedPass(rows, weights, BATCH)
            self._serve(rows, lambda batched=batched: self._batched_pass(batched))
