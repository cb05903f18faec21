"""The flat parameter layout: host statistics, and re-binding to parameters a sharding strategy replaced."""

from __future__ import annotations

import pytest
import torch

from tslightning.core.parameter_layout import ParameterLayout, total_norm


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def test_rebind_points_every_holder_at_the_new_parameters_in_place():
    old, new = _model(0), _model(1)
    layout = ParameterLayout(old.parameters())
    held = layout.parameters  # e.g. the boundary-adjoint helpers keep this list
    layout.rebind(new.parameters())
    assert held is layout.parameters and all(a is b for a, b in zip(held, new.parameters(), strict=True))
    assert torch.equal(layout.values(), torch.cat([p.detach().reshape(-1).double() for p in new.parameters()]))


def test_rebind_refuses_another_model():
    layout = ParameterLayout(_model(0).parameters())
    with pytest.raises(ValueError, match="rebind only the same model's parameters"):
        layout.rebind(torch.nn.Linear(3, 5).parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked host memory needs a CUDA machine")
def test_statistics_are_page_locked_host_memory_on_cuda():
    layout = ParameterLayout(_model(0).cuda().parameters())
    flat = layout.zeros(torch.float32)
    assert flat.device.type == "cpu" and flat.is_pinned()


def test_statistics_live_in_host_memory():
    flat = ParameterLayout(_model(0).parameters()).zeros(torch.float32)
    assert flat.device.type == "cpu" and flat.numel() == 3 * 4 + 4 + 4 * 2 + 2


def test_total_norm_accumulates_float32_in_float64():
    """Issue 17: a float32 norm over the tiny model's 361k values was 1.5e-5 off; accumulated in float64 it is exact."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(361_600, generator=generator) * torch.rand(361_600, generator=generator) ** 4
    pieces = list(values.split([300_000, 61_000, 600]))
    exact = torch.linalg.vector_norm(values.double())
    assert abs(float(torch.linalg.vector_norm(values)) / float(exact) - 1) > 1e-6  # what float32 accumulation gives
    norm = total_norm(pieces)
    assert norm.dtype == torch.float64 and abs(float(norm) / float(exact) - 1) <= 1e-14
    assert float(total_norm(pieces, float("inf"))) == float(values.abs().max())
    assert float(total_norm([])) == 0.0
