"""Pass@k (App. H.1, Eq. 31): the unbiased estimate that at least one of k independent attempts solves a task.

With ``c`` of ``n ≥ k`` attempts on a task successful, Chen et al.'s estimator is ``1 − C(n−c, k) / C(n, k)``;
the benchmark score averages it over tasks, each with equal weight. With ``n = k`` it is the empirical rate of tasks
solved at least once (Eq. 13's pass@3); pass@1 is the mean attempt success rate.

:func:`pass_at_k` is the pure per-task estimator; :class:`PassAtK` accumulates attempts per task as a
``torchmetrics.Metric`` whose state sums across ranks, so attempts may be spread over processes in any way.
Scores are fractions in [0, 1]; multiply by 100 for the paper's percentages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torchmetrics import Metric


def pass_at_k(n: Tensor, c: Tensor, k: int) -> Tensor:
    """Eq. 31's per-task term ``1 − C(n−c, k) / C(n, k)``, elementwise over tasks.

    Computed as ``1 − ∏_{j<k} (n−c−j) / (n−j)`` in float64: k ratios in [0, 1], never a binomial coefficient, so it
    neither overflows nor loses precision for large n. A factor with ``n−c−j ≤ 0`` is clamped to 0, which makes
    the estimate exactly 1 whenever fewer than k attempts failed.

    Args:
        n: Attempts per task (integers ≥ k).
        c: Successful attempts per task (``0 ≤ c ≤ n``).
        k: Attempts the estimate credits a task for.

    Raises:
        ValueError: If ``k < 1``, some ``n < k``, or some ``c`` is outside ``[0, n]``.
    """
    n, c = torch.as_tensor(n, dtype=torch.float64), torch.as_tensor(c, dtype=torch.float64)
    if k < 1:
        raise ValueError(f"pass@k needs k >= 1; got k={k}")
    if bool((n < k).any()):
        raise ValueError(f"pass@{k} needs at least k={k} attempts per task; the fewest here is n={int(n.min())}")
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError("pass@k needs 0 <= c <= n successes on every task")
    j = torch.arange(k, dtype=torch.float64, device=n.device)
    # Drawing k of the n attempts without replacement: factor j is P(draw j fails | the draws before it failed).
    all_fail = ((n - c)[..., None] - j).clamp(min=0) / (n[..., None] - j)
    return 1.0 - all_fail.prod(dim=-1)


class PassAtK(Metric):
    """Pass@k over a fixed list of tasks (Eq. 31), accumulated from per-attempt successes.

    The task list is fixed at construction and every rank must pass the same list in the same order: the state is
    then two ``(num_tasks,)`` count tensors (attempts ``n`` and successes ``c`` per task) reduced with ``sum``, which
    is exact however attempts are split across ranks or updates (counts add; the estimator is applied only in
    :meth:`compute`, to the summed counts). A task with fewer than ``max(k)`` attempts is an error rather than
    being dropped from the denominator (App. E.2).

    Args:
        k: The k (or ks) to report, e.g. ``(1, 3)``.
        tasks: The ids of all evaluated tasks, each weighted equally.

    Example:
        >>> metric = PassAtK(k=(1, 2), tasks=["a", "b"])
        >>> metric.update(["a", "a", "b", "b"], [True, False, False, False])
        >>> {name: round(float(value), 3) for name, value in metric.compute().items()}
        {'pass@1': 0.25, 'pass@2': 0.5}
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    attempts: Tensor
    successes: Tensor

    def __init__(self, k: int | Sequence[int], tasks: Sequence[str], **kwargs) -> None:
        super().__init__(**kwargs)
        self.ks = _check_ks(k)
        self.tasks = list(tasks)
        self._index = {task: index for index, task in enumerate(self.tasks)}
        if not self.tasks or len(self._index) != len(self.tasks):
            raise ValueError("PassAtK: tasks must be a non-empty list of distinct task ids")
        zeros = torch.zeros(len(self.tasks), dtype=torch.long)
        self.add_state("attempts", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("successes", default=zeros.clone(), dist_reduce_fx="sum")

    def update(self, task_ids: Sequence[str], successes: Sequence[bool] | Tensor) -> None:
        """Count attempts: ``task_ids[i]``'s attempt succeeded iff ``successes[i]``."""
        unknown = sorted({task for task in task_ids if task not in self._index})
        if unknown:
            raise KeyError(f"PassAtK.update: tasks not in the metric's task list: {unknown}")
        successes = torch.as_tensor(successes, dtype=torch.bool, device=self.attempts.device).flatten()
        if len(successes) != len(task_ids):
            raise ValueError(f"PassAtK.update: {len(task_ids)} task ids but {len(successes)} successes")
        index = torch.tensor([self._index[task] for task in task_ids], dtype=torch.long, device=self.attempts.device)
        self.attempts.index_add_(0, index, torch.ones_like(index))
        self.successes.index_add_(0, index, successes.long())

    def compute(self) -> dict[str, Tensor]:
        """``{"pass@k": score}`` for each k: Eq. 31 averaged over tasks, as a fraction in [0, 1]."""
        return {name: score.mean() for name, score in self.per_task().items()}

    def per_task(self) -> dict[str, Tensor]:
        """``{"pass@k": (num_tasks,) estimates}`` for each k, in :attr:`tasks` order.

        Raises:
            ValueError: Naming the k and the tasks that have fewer than k attempts.
        """
        result = {}
        for k in self.ks:
            short = [task for task, n in zip(self.tasks, self.attempts.tolist(), strict=True) if n < k]
            if short:
                raise ValueError(
                    f"pass@{k} needs at least k={k} attempts on every task; {len(short)} task(s) have fewer: "
                    f"{', '.join(short[:5])}{', ...' if len(short) > 5 else ''}"
                )
            result[f"pass@{k}"] = pass_at_k(self.attempts, self.successes, k)
        return result


def _check_ks(k: int | Sequence[int]) -> tuple[int, ...]:
    ks = tuple(k) if isinstance(k, Sequence) else (k,)
    if not ks or any(not isinstance(value, int) or isinstance(value, bool) or value < 1 for value in ks):
        raise ValueError(f"PassAtK: k must be a positive integer or a non-empty list of them; got {k!r}")
    return tuple(sorted(set(ks)))
