"""Dense peak FLOP/s of current data-centre accelerators, the denominator of trainer active MFU (Eq. 10, App. B.4).

Lightning's :func:`~lightning.fabric.utilities.throughput.get_available_flops` is the fallback, but it knows no B200
and does not recognise an H200 that reports itself as plain ``"NVIDIA H200"``, and several of its Hopper entries are
the sparse figures (2× dense). The paper divides by the dense BF16 peak (989.5e12 per H200, 2250e12 per B200), so
for the chips below this table comes first; anything else falls back to Lightning's table; a chip neither knows has
no peak (``None``), and MFU is then absent rather than wrong.

Figures are per GPU, dense (no 2:4 sparsity), from the vendors' datasheets. ``float32`` matrix products run as TF32
unless ``torch.get_float32_matmul_precision()`` is ``"highest"`` (as Lightning assumes).
"""

from __future__ import annotations

import warnings

import torch

_TF32 = "tfloat32"

_HOPPER_SXM = {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, _TF32: 494.7e12, torch.float32: 66.9e12}
_HOPPER_NVL = {torch.bfloat16: 835.5e12, torch.float16: 835.5e12, _TF32: 417.5e12, torch.float32: 60.0e12}
_HOPPER_FP64 = {torch.float64: 66.9e12}  # FP64 on the tensor cores

DENSE_PEAK_FLOPS: tuple[tuple[str, dict[torch.dtype | str, float]], ...] = (
    # Matched in this order against the lower-cased device name: the first pattern it contains wins.
    ("gb200", {torch.bfloat16: 2.5e15, torch.float16: 2.5e15, _TF32: 1.25e15, torch.float64: 45e12}),
    ("b200", {torch.bfloat16: 2.25e15, torch.float16: 2.25e15, _TF32: 1.1e15, torch.float64: 37e12}),
    ("b100", {torch.bfloat16: 1.75e15, torch.float16: 1.75e15, _TF32: 0.875e15, torch.float64: 30e12}),
    ("gh200", {**_HOPPER_SXM, **_HOPPER_FP64}),
    ("h200 nvl", {**_HOPPER_NVL, torch.float64: 60.0e12}),
    ("h200", {**_HOPPER_SXM, **_HOPPER_FP64}),
    ("h100 nvl", {**_HOPPER_NVL, torch.float64: 60.0e12}),
    ("h100 pcie", {torch.bfloat16: 756e12, torch.float16: 756e12, _TF32: 378e12, torch.float32: 51.2e12}),
    ("h100", {**_HOPPER_SXM, **_HOPPER_FP64}),  # "H100 80GB HBM3": the SXM part
    ("h800", {**_HOPPER_SXM, torch.float64: 1.0e12}),
    ("a100", {torch.bfloat16: 312e12, torch.float16: 312e12, _TF32: 156e12, torch.float32: 19.5e12}),
    ("l40s", {torch.bfloat16: 362.05e12, torch.float16: 362.05e12, _TF32: 183e12, torch.float32: 91.6e12}),
    ("mi325x", {torch.bfloat16: 1307.4e12, torch.float16: 1307.4e12, _TF32: 653.7e12, torch.float32: 163.4e12}),
    ("mi300x", {torch.bfloat16: 1307.4e12, torch.float16: 1307.4e12, _TF32: 653.7e12, torch.float32: 163.4e12}),
)
"""(name pattern, FLOP/s by compute dtype) per chip; ``"tfloat32"`` is float32 matrix work on the tensor cores."""


def dense_peak_flops(device_name: str, dtype: torch.dtype) -> float | None:
    """One device's dense peak FLOP/s in ``dtype`` from :data:`DENSE_PEAK_FLOPS`, ``None`` when the table has no
    entry for the chip or the dtype (e.g. float32 on a B200, float64 on a consumer card)."""
    name = device_name.lower()
    for pattern, figures in DENSE_PEAK_FLOPS:
        if pattern in name:
            return figures.get(_table_dtype(dtype, figures))
    return None


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    """The peak FLOP/s of ``device`` in ``dtype``: this module's table for the chips it lists, else Lightning's
    ``get_available_flops``; ``None`` where neither knows the chip (a CPU, an unknown accelerator)."""
    if device.type != "cuda":
        return None  # Lightning's table knows TPUs, not CPUs; we train on neither without an explicit peak
    peak = dense_peak_flops(torch.cuda.get_device_name(device), dtype)
    if peak is not None:
        return peak
    from lightning.fabric.utilities.throughput import get_available_flops

    with warnings.catch_warnings():  # its "FLOPs not found" warning: the monitor warns once, naming the override
        warnings.simplefilter("ignore")
        return get_available_flops(device, dtype) or None


def _table_dtype(dtype: torch.dtype, figures: dict) -> torch.dtype | str:
    if dtype == torch.float32 and _TF32 in figures and torch.get_float32_matmul_precision() != "highest":
        return _TF32
    return dtype
