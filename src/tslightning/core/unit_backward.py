"""One backward pass whose parameter gradients are handed on unit by unit as autograd produces them, never whole.

``torch.autograd.grad(score, parameters)`` returns every parameter's gradient at once: a whole model's worth per
source (122 GiB in fp32 at 32B). :class:`UnitBackward` instead registers a hook on every parameter leaf for the
duration of one backward. A hook receives that parameter's finished gradient (autograd has summed every use of it,
tied embeddings included), keeps it with the other gradients of its unit
(:mod:`~tslightning.core.gradient_units`) and returns a zero-stride zero tensor in its place, so autograd keeps
nothing. Once a unit is complete it is handed to ``fold`` — in the fixed fold order (last unit first), a unit waits
for the units before it in that order — and dropped. What is live at any moment is the unit being produced, plus any
completed early out of order (none for a causal LM's backward).

Exactness: each parameter's gradient is the one ``torch.autograd.grad`` would return, bit for bit (the hook sees the
captured gradient), so folding it unit by unit applies the same values to the statistics, parameter by parameter.

Order: every unit is folded exactly once per backward, in :func:`~tslightning.core.gradient_units.fold_order`;
units no gradient reached (a parameter the pass did not use) are folded empty at the end, in the same order. Two
ranks running passes of the same model therefore fold (and, with sharded statistics, exchange) the same units in the
same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tslightning.core.gradient_units import fold_order

UnitFold = Callable[[int, dict[int, torch.Tensor]], None]
"""Receives a complete unit: its index and ``{parameter index: gradient}`` (parameters that got no gradient absent)."""


class UnitBackward:
    """Back-propagates passes over parameter ``leaves`` grouped into ``units``, folding each unit as it completes.

    Args:
        units: Parameter indices per unit (:func:`~tslightning.core.gradient_units.gradient_units`).
    """

    def __init__(self, units: Sequence[Sequence[int]]) -> None:
        self.units = [list(unit) for unit in units]
        self.order = fold_order(self.units)
        self._unit_of = {i: u for u, unit in enumerate(self.units) for i in unit}
        self.peak_live_numel = 0
        """Most gradient values held at once by any backward (units produced but not yet folded)."""

    def run(
        self,
        outputs: Sequence[torch.Tensor],
        leaves: Sequence[torch.Tensor],
        fold: UnitFold,
        inputs: Sequence[torch.Tensor] = (),
        grad_outputs: Sequence[torch.Tensor] | None = None,
        retain_graph: bool = False,
    ) -> list[torch.Tensor]:
        """Back-propagate ``outputs``; fold every unit of the parameter ``leaves``' gradients; return the gradients of
        the other ``inputs`` (zeros where unused). ``leaves`` follow the layout order the units index."""
        pass_ = _Pass(self, fold)
        kept = [i for i, x in enumerate(outputs) if x.requires_grad]
        handles = [leaf.register_hook(pass_.hook(i)) for i, leaf in enumerate(leaves)]
        try:
            grads: Sequence[torch.Tensor | None] = (None,) * len(inputs)
            if kept:
                grads = torch.autograd.grad(
                    [outputs[i] for i in kept],
                    list(leaves) + list(inputs),
                    grad_outputs=None if grad_outputs is None else [grad_outputs[i] for i in kept],
                    retain_graph=retain_graph,
                    allow_unused=True,
                )[len(leaves) :]
        finally:
            for handle in handles:
                handle.remove()
        pass_.finish()
        return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)]


class _Pass:
    """The bookkeeping of one backward: gradients of units not yet folded, and the next unit to fold."""

    def __init__(self, backward: UnitBackward, fold: UnitFold) -> None:
        self.backward = backward
        self.fold = fold
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.missing = [len(unit) for unit in backward.units]
        self.position = 0  # into backward.order
        self.live = 0

    def hook(self, index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def keep(grad: torch.Tensor) -> torch.Tensor:
            unit = self.backward._unit_of[index]
            self.pending.setdefault(unit, {})[index] = grad.detach()
            self.missing[unit] -= 1
            self.live += grad.numel()
            self.backward.peak_live_numel = max(self.backward.peak_live_numel, self.live)
            self._fold_ready()
            return grad.new_zeros(()).expand_as(grad)  # autograd keeps this, not the gradient: no storage

        return keep

    def _fold_ready(self) -> None:
        order = self.backward.order
        while self.position < len(order) and self.missing[order[self.position]] == 0:
            self._fold(order[self.position])

    def _fold(self, unit: int) -> None:
        grads = self.pending.pop(unit, {})
        self.position += 1
        self.fold(unit, grads)
        self.live -= sum(g.numel() for g in grads.values())

    def finish(self) -> None:
        """Fold the units still open (some parameter got no gradient), in the fold order."""
        while self.position < len(self.backward.order):
            self._fold(self.backward.order[self.position])
