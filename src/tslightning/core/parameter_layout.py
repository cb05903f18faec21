"""A flat view of the trainable parameters, so gradient statistics are single contiguous vectors; and their global
norm, accumulated in float64."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch


def total_norm(tensors: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The global ``norm_type``-norm of ``tensors`` (e.g. every parameter's ``.grad``) as a float64 scalar tensor.

    Each tensor's norm is accumulated in float64 (``vector_norm(..., dtype=torch.float64)``), so float32 values enter
    an exact-enough sum: ``torch.linalg.vector_norm`` of a float32 vector accumulates in float32 on a CPU and is
    1.5e-5 off on 361k entries, 1.8e-4 on 3.6M. ``torch.nn.utils.clip_grads_with_norm_`` takes the result.
    """
    norms = [torch.linalg.vector_norm(t.detach(), norm_type, dtype=torch.float64) for t in tensors]
    if not norms:
        return torch.zeros((), dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)


class ParameterLayout:
    """Fixed order and offsets of the trainable parameters (``requires_grad=True``) of a model.

    Gradient statistics (G1, G2, the batch accumulator) are flat ``(numel,)`` vectors in this order, which keeps
    their memory exactly ``numel`` values each and makes the App. D.3 bound easy to state and check.
    """

    def __init__(self, parameters: Iterable[torch.nn.Parameter], statistics_device: str = "host") -> None:
        self.parameters: list[torch.nn.Parameter] = [p for p in parameters if p.requires_grad]
        if statistics_device not in ("host", "device"):
            raise ValueError(f"statistics_device must be 'host' or 'device'; got {statistics_device!r}")
        self.statistics_device = statistics_device
        """Where flat statistics live: ``host`` memory (page-locked on a CUDA machine) or the parameters' device."""
        self._staging: torch.Tensor | None = None
        if not self.parameters:
            raise ValueError("the model has no trainable parameters (requires_grad=True); nothing to stream")
        self.numel = sum(p.numel() for p in self.parameters)
        self.shapes: list[torch.Size] = [p.shape for p in self.parameters]
        """Full shapes, recorded before any sharding strategy (ZeRO-3, FSDP) partitions the parameters."""
        self.units: list[list[int]] = [[i] for i in range(len(self.parameters))]
        """Parameter indices per gradient unit (:mod:`~tslightning.core.gradient_units`; set by the learner from the
        model's blocks); one parameter per unit until then."""
        self._slices: list[slice] = []
        offset = 0
        for p in self.parameters:
            self._slices.append(slice(offset, offset + p.numel()))
            offset += p.numel()

    def rebind(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Point at new parameter objects of the same model (a sharding strategy replaced them), in place, so every
        holder of :attr:`parameters` sees them.

        Raises:
            ValueError: if the trainable parameters' count or full shapes differ.
        """
        new = [p for p in parameters if p.requires_grad]
        shapes = [p.shape for p in new]
        if shapes != self.shapes:
            raise ValueError(
                f"rebind: the new trainable parameters have shapes {shapes[:4]}... ({len(new)} tensors); the layout "
                f"was built for {self.shapes[:4]}... ({len(self.shapes)}); rebind only the same model's parameters"
            )
        self.parameters[:] = new

    def zeros(self, dtype: torch.dtype) -> torch.Tensor:
        """A new flat zero vector where statistics live: host memory (where the paper keeps FP32 statistics, App. D.3),
        page-locked on a CUDA machine so gradients copy into it by DMA; or the parameters' device."""
        if self.statistics_device == "device":
            return torch.zeros(self.numel, dtype=dtype, device=self.parameters[0].device)
        return torch.zeros(self.numel, dtype=dtype, device="cpu", pin_memory=torch.cuda.is_available())

    def placed(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` if it lives where statistics live now, else a new zero vector there (the parameters moved to
        their device after the statistics were allocated)."""
        if self.statistics_device == "device" and flat.device != self.parameters[0].device:
            return self.zeros(flat.dtype)
        return flat

    def gather(self, grads: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One source's per-parameter gradients as one flat vector where statistics live, copied there once.

        Host statistics reuse one staging vector (returned; valid until the next call): every gradient is queued
        into it without blocking, and a single synchronization waits for all the copies.
        """
        if self.statistics_device == "device" or self.parameters[0].device.type == "cpu":
            device = self.parameters[0].device if self.statistics_device == "device" else torch.device("cpu")
            return torch.cat([g.detach().reshape(-1).to(device=device, dtype=dtype) for g in grads])
        if self._staging is None or self._staging.dtype != dtype:
            self._staging = self.zeros(dtype)
        for s, g in zip(self._slices, grads, strict=True):
            self._staging[s].copy_(g.detach().reshape(-1), non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the copies into page-locked memory have landed
        return self._staging

    def unit_pieces(
        self, flat: torch.Tensor, grads: dict[int, torch.Tensor], alpha: float
    ) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """Fold pieces (:mod:`~tslightning.core.unit_folding`) adding ``alpha · grads`` (``{parameter index:
        full-shape gradient}``) into ``flat``: one ``(view of flat, gradient, alpha)`` per parameter."""
        return [(flat[self._slices[i]], g, alpha) for i, g in grads.items()]

    @property
    def slices(self) -> list[slice]:
        """Each parameter's slice of a flat statistic, in :attr:`parameters` order."""
        return list(self._slices)

    def add_(self, flat: torch.Tensor, grads: Sequence[torch.Tensor], alpha: float = 1.0) -> None:
        """``flat += alpha * grads`` where ``grads`` follows :attr:`parameters` (as from ``torch.autograd.grad``)."""
        for s, g in zip(self._slices, grads, strict=True):
            flat[s].add_(g.detach().reshape(-1).to(device=flat.device, dtype=flat.dtype), alpha=alpha)

    def write_grads(self, flat: torch.Tensor, scale: float = 1.0) -> None:
        """Set every parameter's ``.grad`` to ``scale * flat[its slice]`` in the parameter's dtype and device."""
        for p, s in zip(self.parameters, self._slices, strict=True):
            p.grad = (flat[s] * scale).view_as(p).to(device=p.device, dtype=p.dtype)

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` in :attr:`parameters` order, each in its parameter's full shape."""
        return [flat[s].view(shape) for s, shape in zip(self._slices, self.shapes, strict=True)]

    def read_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """The parameters' current ``.grad`` as one flat vector (zeros where a grad is None)."""
        flat = self.zeros(dtype)
        for p, s in zip(self.parameters, self._slices, strict=True):
            if p.grad is not None:
                flat[s] = p.grad.detach().reshape(-1).to(device="cpu", dtype=dtype)
        return flat

    def values(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The parameters themselves as one flat host vector (for parameter gaps, Eq. 30)."""
        return torch.cat([p.detach().reshape(-1).to(device="cpu", dtype=dtype) for p in self.parameters])
