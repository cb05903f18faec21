"""Weight publication into vLLM workers through shared memory (App. D.2).

The learner writes θ_{k+1} into one file-backed shared-memory buffer (:class:`SharedWeights`, under ``/dev/shm``) and
sends each vLLM worker only its small, picklable :class:`WeightLayout` through ``LLM.collective_rpc``: tensors
themselves cannot travel through ``collective_rpc``. :class:`WeightPublicationExtension` is mixed into every worker
(``LLM(worker_extension_cls=...)``); it maps the buffer and reloads the weights in place.

This module imports no vLLM at import time, so the learner side runs without it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["SharedWeights", "WeightLayout", "WeightPublicationExtension", "iter_shared_weights", "retie_lm_head"]

# Offsets are aligned so that every view of the byte buffer is aligned for any dtype (and for vectorized copies).
_ALIGNMENT = 64


@dataclass(frozen=True)
class WeightLayout:
    """Where each tensor lives in the shared buffer: what a worker needs to read it (plain, picklable data).

    Attributes:
        path: The buffer's file (on ``/dev/shm`` where it exists, so it never touches a disk).
        nbytes: The buffer's size.
        tensors: ``(name, dtype, shape, byte offset)`` per tensor, in the order the learner gave them.
    """

    path: str
    nbytes: int
    tensors: tuple[tuple[str, str, tuple[int, ...], int], ...]

    def to_message(self) -> dict[str, Any]:
        """Builtins only: vLLM's multiprocess RPC (msgpack) sends these without pickling."""
        return {"path": self.path, "nbytes": self.nbytes, "tensors": [list(entry) for entry in self.tensors]}

    @classmethod
    def from_message(cls, message: Mapping[str, Any]) -> WeightLayout:
        """Inverse of :meth:`to_message` (msgpack turns tuples into lists)."""
        tensors = tuple((name, dtype, tuple(shape), offset) for name, dtype, shape, offset in message["tensors"])
        return cls(message["path"], message["nbytes"], tensors)


def _shared_memory_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _views(buffer: torch.Tensor, layout: WeightLayout) -> dict[str, torch.Tensor]:
    views = {}
    for name, dtype, shape, offset in layout.tensors:
        element = getattr(torch, dtype)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=element).element_size()
        views[name] = buffer[offset : offset + nbytes].view(element).view(shape)
    return views


class SharedWeights:
    """A shared-memory staging buffer that the learner fills and every worker on the node reads.

    Args:
        tensors: Each tensor's ``name``, ``dtype`` and ``shape`` to lay out, in order — a
            :meth:`~tslightning.rollout.engine.WeightStream.metadata` list, or a state dict's tensors (values are not
            copied; call :meth:`write`).
        dtype: Dtype to store floating-point tensors in (the serving dtype, so workers copy without converting);
            ``None`` keeps each tensor's own dtype.
    """

    def __init__(self, tensors: Sequence[Any] | Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> None:
        entries, offset = [], 0
        for name, held, shape in _described(tensors):
            stored = dtype if dtype is not None and held.is_floating_point else held
            entries.append((name, str(stored).removeprefix("torch."), shape, offset))
            nbytes = torch.Size(shape).numel() * torch.empty((), dtype=stored).element_size()
            offset += -(-nbytes // _ALIGNMENT) * _ALIGNMENT
        fd, path = tempfile.mkstemp(prefix="tslightning-weights-", dir=_shared_memory_dir())
        try:
            os.ftruncate(fd, max(offset, 1))
        finally:
            os.close(fd)
        self.layout = WeightLayout(path, max(offset, 1), tuple(entries))
        self._buffer = torch.from_file(path, shared=True, size=self.layout.nbytes, dtype=torch.uint8)
        self._views = _views(self._buffer, self.layout)

    def matches(self, tensors: Sequence[Any] | Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` (as for the constructor) have exactly this buffer's names and shapes, in order."""
        described = [(name, shape) for name, _, shape in _described(tensors)]
        return described == [(name, tuple(view.shape)) for name, view in self._views.items()]

    @torch.no_grad()
    def write(self, tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
        """Copy each ``(name, tensor)`` (any device, any floating dtype; a state dict's items) into the buffer as it
        comes, so a stream never holds more than one of them."""
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        for name, tensor in pairs:
            self._views[name].copy_(tensor.detach())

    def close(self) -> None:
        """Drop the mapping and delete the file."""
        self._views.clear()
        self._buffer = torch.empty(0, dtype=torch.uint8)
        try:
            os.unlink(self.layout.path)
        except FileNotFoundError:
            pass


def _described(tensors: Sequence[Any] | Mapping[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """``(name, dtype, shape)`` of a state dict's tensors or of ``name``/``dtype``/``shape`` records."""
    if isinstance(tensors, Mapping):
        return [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in tensors.items()]
    return [(meta.name, meta.dtype, tuple(meta.shape)) for meta in tensors]


def iter_shared_weights(layout: WeightLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """Map the buffer described by ``layout`` and yield ``(name, tensor)`` views into it (no copies)."""
    buffer = torch.from_file(layout.path, shared=True, size=layout.nbytes, dtype=torch.uint8)
    yield from _views(buffer, layout).items()


class WeightPublicationExtension:
    """Methods mixed into each vLLM worker; the engine calls them through ``LLM.collective_rpc``."""

    def load_published_weights(self, message: Mapping[str, Any]) -> int:
        """Reload every weight in place from the buffer ``WeightLayout.to_message()`` describes; returns the number
        of tensors read.

        vLLM's in-place reload re-runs each layer's post-load processing (on CPU, the packed GEMM weights). A tied
        LM head receives no weights of its own (its checkpoint name is skipped) and is not re-processed, so it is
        re-tied to the embedding and re-processed here: a GEMM path that packs weights into a separate buffer would
        otherwise keep computing logits from the old embedding.
        """
        worker: Any = self  # a vLLM Worker once mixed in
        layout = WeightLayout.from_message(message)
        worker.reload_weights(weights_iterator=iter_shared_weights(layout), is_checkpoint_format=True)
        if getattr(worker.vllm_config.model_config.hf_text_config, "tie_word_embeddings", False):
            retie_lm_head(worker.model_runner.get_model())
        return len(layout.tensors)


def retie_lm_head(model: Any) -> None:
    """A tied LM head receives no weights of its own (its checkpoint name is skipped) and is not re-processed by the
    reload: re-tie it to the embedding and re-run its post-load processing (on CPU, the packed GEMM weights), or the
    logits would keep coming from the old embedding."""
    lm_head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if lm_head is None or embed is None or not hasattr(lm_head, "quant_method"):
        return
    lm_head.quant_method.tie_weights(lm_head, embed)
    lm_head.quant_method.process_weights_after_loading(lm_head)
