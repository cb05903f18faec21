"""GradientClipping under a Trainer and Fabric: the module's own clipping exactly, and no step on a non-finite norm."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader

from tslightning.callbacks import GradientClipping
from tslightning.replay_batches import ReplayBatch, WorkloadShape, synthetic_grpo_batch
from tslightning.streaming_module import StreamingPolicyModule

SMALL = WorkloadShape(
    num_groups=2, group_size=3, max_turns=2, prompt_tokens=(3, 6), action_tokens=(2, 4), observation_tokens=(2, 4)
)
HOSTS = ["trainer", "fabric"]
TORCH_CLIP_EPS = 1e-6


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class MemoryLogger(Logger):
    """Keeps every ``(step, metrics)`` it is given; works for a Trainer and for Fabric."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, float]]] = []

    name = "memory"
    version = 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))

    def having(self, key: str) -> list[tuple[int | None, dict[str, float]]]:
        return [(step, metrics) for step, metrics in self.logged if key in metrics]


def run_updates(host: str, module, batches: list[ReplayBatch], callbacks, logger: Logger, tmp_path) -> None:
    """Each batch as one update: a Trainer over its stream items, or our Fabric loop calling the hooks."""
    if host == "trainer":
        items = [item for batch in batches for item in batch.stream()]
        L.Trainer(
            max_epochs=1,
            accelerator="cpu",
            devices=1,
            callbacks=callbacks,
            logger=logger,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        ).fit(module, train_dataloaders=DataLoader(items, batch_size=None))
        return
    # Keywords, not positions: fabric.setup registers the LightningModule as a callback too, and Fabric passes each
    # callback only the keywords its hook names (the module's hooks take no trainer/pl_module).
    fabric = L.Fabric(accelerator="cpu", devices=1, callbacks=callbacks, loggers=[logger])
    wrapped, optimizer = fabric.setup(module, module.configure_optimizers())
    for k, batch in enumerate(batches):
        for item in batch.stream():
            wrapped.ingest(item)
        wrapped.barrier(
            optimizer,
            before_step=lambda: fabric.call(
                "on_before_optimizer_step", trainer=fabric, pl_module=wrapped, optimizer=optimizer
            ),
        )
        fabric.call(
            "on_train_batch_end", trainer=fabric, pl_module=wrapped, outputs=None, batch=batch.items[-1], batch_idx=k
        )


class SGDModule(StreamingPolicyModule):
    """SGD(lr=1): θ_1 − θ_0 is minus the ``.grad`` the optimizer saw, so any clipping difference shows in θ."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.layout.parameters, lr=1.0)


class PoisonGradient(L.Callback):
    """Ordered before GradientClipping: writes ``value`` into the batch direction in ``.grad``."""

    def __init__(self, value: float) -> None:
        self.value = value

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        optimizer.param_groups[0]["params"][0].grad.view(-1)[0] = self.value


def grpo_batch(vocab_size: int) -> ReplayBatch:
    return synthetic_grpo_batch(vocab_size, 0, torch.Generator().manual_seed(0), SMALL)


@pytest.mark.parametrize("host", HOSTS)
def test_callback_clipping_equals_the_modules_own(make_policy, vocab_size, host, tmp_path):
    batch = grpo_batch(vocab_size)
    builtin = SGDModule(make_policy(), max_grad_norm=1.0)
    theta0 = builtin.layout.values()
    for item in batch.stream():
        builtin.ingest(item)
    norm = builtin.barrier(builtin.configure_optimizers()).direction_norm
    assert norm > 2.0, "the batch direction must exceed max_norm for clipping to act"

    module, clipping, logger = SGDModule(make_policy(), max_grad_norm=None), GradientClipping(1.0), MemoryLogger()
    run_updates(host, module, [batch], [clipping], logger, tmp_path)

    assert module.policy_version == 1
    assert torch.equal(module.layout.values(), builtin.layout.values())
    assert float((module.layout.values() - theta0).norm()) == pytest.approx(1.0, rel=2 * TORCH_CLIP_EPS)
    ((step, metrics),) = logger.having("actor/grad_clip_coef")
    assert step == 0
    assert metrics["actor/grad_norm"] == pytest.approx(norm, rel=1e-12)
    assert metrics["actor/grad_clip_coef"] == pytest.approx(1.0 / (norm + TORCH_CLIP_EPS), rel=1e-12)
    restored = GradientClipping(1.0)
    restored.load_state_dict(clipping.state_dict())
    assert restored.state_dict() == clipping.state_dict()
    assert clipping.state_dict() == {
        "updates": 1,
        "clipped_updates": 1,
        "last_grad_norm": metrics["actor/grad_norm"],
        "last_clip_coefficient": metrics["actor/grad_clip_coef"],
    }


@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("host", HOSTS)
def test_non_finite_direction_is_refused_without_a_step(make_policy, vocab_size, host, value, tmp_path):
    module, clipping, logger = (
        StreamingPolicyModule(make_policy(), max_grad_norm=None),
        GradientClipping(),
        MemoryLogger(),
    )
    theta0 = module.layout.values()
    steps = []
    handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
    try:
        with pytest.raises(FloatingPointError, match=r"update 0 \(θ_0 → θ_1\) has a non-finite .* refusing to step"):
            run_updates(host, module, [grpo_batch(vocab_size)], [PoisonGradient(value), clipping], logger, tmp_path)
    finally:
        handle.remove()
    assert steps == []
    assert torch.equal(module.layout.values(), theta0)
    assert module.policy_version == 0 and module.num_optimizer_steps == 0
    assert clipping.updates == 0 and logger.having("actor/grad_clip_coef") == []


def test_refuses_to_clip_what_the_module_already_clips(make_policy):
    module = StreamingPolicyModule(make_policy(), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="construct the module with max_grad_norm=None"):
        GradientClipping().on_before_optimizer_step(L.Fabric(accelerator="cpu", devices=1), module, None)


def test_bad_arguments_are_reported_together():
    with pytest.raises(ValueError, match=r"max_norm must be > 0 .*; norm_type must be > 0"):
        GradientClipping(max_norm=0.0, norm_type=-1.0)
