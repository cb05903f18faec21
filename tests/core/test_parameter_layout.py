"""The flat parameter layout: host statistics, and re-binding to parameters a sharding strategy replaced."""

from __future__ import annotations

import pytest
import torch

from tslightning.core.parameter_layout import ParameterLayout


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
