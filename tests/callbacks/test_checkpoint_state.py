"""Checkpointed RNG states: a rank saves and restores its own GPU's generator only, never every visible GPU's."""

from __future__ import annotations

import pytest
import torch

from tslightning.callbacks.checkpoint_state import rng_states, set_rng_states


@pytest.fixture
def four_gpus_on_device_2(monkeypatch):
    """A process whose device is cuda:2 of four: every touched device is recorded; the every-GPU calls fail."""
    touched: list[tuple[str, int]] = []

    def every_gpu(*args, **kwargs):
        raise AssertionError("touched every visible GPU (a CUDA context on each)")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", every_gpu)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: touched.append(("get", device)) or torch.ones(3))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: touched.append(("set", device)))
    return touched


def test_only_this_ranks_gpu_generator_is_saved_and_restored(four_gpus_on_device_2):
    states = rng_states()
    assert torch.equal(states["cuda"], torch.ones(3))
    set_rng_states(states)
    assert four_gpus_on_device_2 == [("get", 2), ("set", 2)]


def test_an_older_checkpoint_with_every_gpus_state_restores_this_ranks_entry(four_gpus_on_device_2):
    states = rng_states()
    states["cuda"] = [torch.zeros(3)] * 4
    set_rng_states(states)
    assert four_gpus_on_device_2 == [("get", 2), ("set", 2)]
