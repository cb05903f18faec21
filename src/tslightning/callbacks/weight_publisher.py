"""Publication of θ_{k+1} to every rollout replica after update k, acknowledged before batch k+1 starts (Eq. 3).

One small versioned operation: ``engine.publish(weights, k + 1)`` (which returns only once every replica acknowledged
and cleared its policy-dependent caches), check the receipt's version, record the time. For an engine that accepts
a stream (``accepts_weight_stream``, as tslightning's engines do) ``weights`` is one
(:mod:`tslightning.callbacks.published_weights`): one full tensor at a time, cast to the engine's serving dtype, each
pass ordered after the optimizer step's kernels — the learner never stages a full copy of the model. Any other
engine gets a plain state dict of those full tensors (one pass), so an engine written as
``publish(state_dict, version)`` that calls ``model.load_state_dict(state_dict)`` works unchanged.

Learner ranks sharing rollout servers (an engine whose ``shared_servers`` is true, e.g. ``vllm_server`` on several
ranks) publish once per server: global rank 0 streams the weights to every server while the others join each
tensor's gather (FSDP2 / ZeRO-3), and its outcome — with what the servers now serve — is broadcast, so every other
rank's engine adopts the new version only after every server acknowledged it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from threading import Thread
from typing import Any

import lightning as L
import torch

from tslightning.callbacks.published_weights import PublishedWeights, merged_lora_tensors, step_completion
from tslightning.callbacks.update_callback import Publication, UpdateCallback, module_name
from tslightning.distributed.collectives import control_all_reduce, control_broadcast
from tslightning.distributed.parameter_placement import ParameterPlacement, placement_of
from tslightning.learner.update_log import log_update_metrics
from tslightning.measure.device_clock import synchronized_clock
from tslightning.rollout.engine import PublishReceipt, RolloutEngine, RolloutEngineError, WeightStream


class WeightPublisher(UpdateCallback):
    """After each update, publishes the trainable policy's full weights at the module's new policy version k + 1.

    The engine lives with global rank 0, which publishes; the outcome is then broadcast, so every rank waits for the
    acknowledgement and fails together if publication failed. With ``every_rank=True`` (rank-aware rollout: each
    learner rank drives its own engine) every rank publishes to its engine and the outcomes are all-reduced — unless
    the engines share their servers (``engine.shared_servers``): rank 0's then publishes and the others ``follow``
    its ``served()`` (see the module docstring). Keeps
    the :attr:`last_publication` (version, seconds until acknowledged, when), where the MFU monitor, the release trace
    and checkpoints read it whatever their order; also writes ``update_timings["publication_s"]`` when the module
    keeps such a dict, and logs ``timing_s/update_weights`` for update k.

    At ``on_train_start`` an engine that serves another version than the module holds (a resumed run: the engine
    started at version 0) is first sent the module's current weights at that version.

    Args:
        engine: The rollout engine; its ``publish`` returns after every replica acknowledged. ``None``: set
            :attr:`engine` before the first update (e.g. once each rank started its engine after ``fabric.launch()``).
        timeout_s: Seconds to wait for the acknowledgement before failing; ``None`` waits as long as the engine does.
        every_rank: Each learner rank has its own engine (it rolls out its own groups) and publishes to it.
        policy: Returns the model the engine serves, given the LightningModule; ``None`` reads the module's
            ``policy`` attribute (the streaming module's).
        name: Distinguishes several publishers in a checkpoint (their ``state_key``).
    """

    publishes = True

    def __init__(
        self,
        engine: RolloutEngine | None = None,
        timeout_s: float | None = None,
        every_rank: bool = False,
        policy: Callable[[Any], torch.nn.Module] | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__()
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"WeightPublisher: timeout_s must be > 0 or None; got {timeout_s}")
        self.engine = engine
        self.timeout_s = timeout_s
        self.every_rank = every_rank
        self.policy = policy
        self.name = name
        self.published_version: int | None = None
        self.publications = 0
        self.last_publication: Publication | None = None

    @property
    def state_key(self) -> str:
        named = {} if self.name is None else {"name": self.name}
        return self._generate_state_key(engine=type(self.engine).__qualname__, **named)

    def check_host(self, trainer: Any, pl_module: Any) -> None:
        if self.policy is None and not isinstance(getattr(pl_module, "policy", None), torch.nn.Module):
            raise ValueError(
                f"WeightPublisher needs the model the rollout engine serves: {module_name(pl_module)} has no "
                "`policy` module; give it one or pass WeightPublisher(engine, policy=lambda module: module.model)"
            )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """A resumed run: have the engine serve the restored θ_k at version k before update k samples anything."""
        super().on_train_start(trainer, pl_module)
        self._require_engine()
        version = self.current_index(trainer, pl_module)
        if self._engines_serve_another(trainer, version):
            self._publish_everywhere(trainer, pl_module, version)

    def on_update_end(self, trainer: Any, pl_module: Any, k: int, batch: Any) -> None:
        """Update k took its step: publish θ_{k+1} at version k + 1 and wait for every replica's acknowledgement.

        Raises:
            RolloutEngineError: If a replica did not acknowledge (in ``timeout_s``), or the receipt names another
                version.
        """
        self._require_engine()
        version = k + 1
        device = trainer.strategy.root_device
        start = synchronized_clock(device)
        self._publish_everywhere(trainer, pl_module, version)
        seconds = synchronized_clock(device) - start
        self.last_publication = Publication(version, seconds, time.time())
        timings = getattr(pl_module, "update_timings", None)
        if isinstance(timings, dict):
            timings["publication_s"] = seconds
        self.published_version = version
        self.publications += 1
        log_update_metrics(trainer, pl_module, {"timing_s/update_weights": seconds}, step=k)

    def _publish_everywhere(self, trainer: Any, pl_module: Any, version: int) -> None:
        """Stream θ_{k+1} (FSDP2 / ZeRO-3: each tensor a collective of every rank) to the engine(s) at ``version``."""
        shared = self.every_rank and bool(getattr(self.engine, "shared_servers", False))
        leads = (shared or not self.every_rank) and trainer.global_rank == 0  # rank 0 publishes for every rank
        placement = placement_of(pl_module, trainer.strategy)
        weights = publication_weights(self._policy_of(pl_module), self.engine, placement, leads)
        if shared:
            publish_to_shared_servers(self.engine, weights, version, trainer.global_rank, self.timeout_s)
        elif self.every_rank:
            self._publish_from_every_rank(trainer, weights, version)
        else:
            self._publish_from_rank_zero(trainer, weights, version)

    def _engines_serve_another(self, trainer: Any, version: int) -> bool:
        """Whether rank 0's engine (every rank's, with ``every_rank``) serves a version other than ``version``; the
        same answer on every rank, since the publication that follows is collective."""
        stale = self.engine.policy_version != version
        if trainer.world_size == 1:
            return stale
        if not self.every_rank:
            return bool(trainer.strategy.broadcast(stale, src=0))
        return float(control_all_reduce(torch.tensor([float(stale)]))[0]) > 0  # a host flag: over gloo

    def _adapter_only(self) -> bool:
        """Whether the engine serves a LoRA adapter over fixed base weights (it then takes the adapter alone)."""
        return bool(getattr(self.engine, "publishes_adapter", False))

    def _require_engine(self) -> None:
        if self.engine is None:
            raise RuntimeError("WeightPublisher has no engine: pass one, or set .engine before training starts")

    def _policy_of(self, module: Any) -> torch.nn.Module:
        return self.policy(module) if self.policy is not None else module.policy

    def _publish_from_rank_zero(self, trainer: L.Trainer | L.Fabric, weights: WeightStream, version: int) -> None:
        """Rank 0 publishes (the others join a sharded policy's gathers); every rank raises if it failed."""
        error = None
        if trainer.global_rank == 0:
            try:
                self._publish(weights, version)
            except Exception as exc:
                error = exc
            finally:
                _finish(weights)
        else:
            _follow(weights)
        # The broadcast is also the sync point: no rank starts batch k+1 before every replica acknowledged θ_{k+1}.
        failure = trainer.strategy.broadcast(None if error is None else f"{type(error).__name__}: {error}", src=0)
        if error is not None:
            raise error
        if failure is not None:
            raise RolloutEngineError(f"global rank 0 failed to publish θ_{version}: {failure}")

    def _publish_from_every_rank(self, trainer: L.Trainer | L.Fabric, weights: WeightStream, version: int) -> None:
        """Every rank publishes to its own engine; every rank raises if any of them failed."""
        error = None
        try:
            self._publish(weights, version)
        except Exception as exc:
            error = exc
        # The all-reduce is also the sync point: no rank starts batch k+1 before every engine acknowledged θ_{k+1}.
        (failed,) = control_all_reduce(torch.tensor([float(error is not None)])).tolist()  # a host flag: over gloo
        if error is not None:
            raise error
        if failed > 0:
            raise RolloutEngineError(f"{int(failed)} learner rank(s) failed to publish θ_{version}")

    def _publish(self, weights: WeightStream, version: int) -> PublishReceipt:
        receipt = _wait_for(lambda: hand_over_weights(self.engine, weights, version), self.timeout_s, version)
        return _checked(receipt, version)

    def state_dict(self) -> dict[str, Any]:
        return {"published_version": self.published_version, "publications": self.publications}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.published_version = state_dict["published_version"]
        self.publications = state_dict["publications"]


def publish_to_shared_servers(
    engine: Any,
    weights: Mapping[str, torch.Tensor] | WeightStream,
    version: int,
    rank: int,
    timeout_s: float | None = None,
) -> None:
    """Every learner rank calls this: global rank 0's engine publishes ``weights`` at ``version`` to the servers all
    ranks sample from, once each; the other ranks join a sharded policy's gathers (:meth:`PublishedWeights.follow`),
    then their engines ``follow`` what it reports serving.

    The first agreement holds rank 0 until every rank finished sampling (no request of any rank is in flight when the
    servers pause); the broadcast of rank 0's outcome is the second: no rank samples at ``version`` before every
    server acknowledged it, and every rank raises if the publication failed.

    Raises:
        RolloutEngineError: On every rank if rank 0's publication failed (rank 0 raises its own error).
    """
    control_all_reduce(torch.zeros(1))  # every rank reached publication: its rollouts are done
    outcome: Any = None
    error: Exception | None = None
    if rank == 0:
        try:
            _checked(_wait_for(lambda: hand_over_weights(engine, weights, version), timeout_s, version), version)
            outcome = engine.served()
        except Exception as exc:
            outcome, error = f"{type(exc).__name__}: {exc}", exc
        finally:
            _finish(weights)
    else:
        _follow(weights)
    outcome = control_broadcast(outcome, src=0)
    if error is not None:
        raise error
    if isinstance(outcome, str):
        raise RolloutEngineError(f"global rank 0 failed to publish θ_{version} to the shared servers: {outcome}")
    if rank != 0:
        engine.follow(outcome)


def publication_weights(
    policy: torch.nn.Module, engine: Any, placement: ParameterPlacement, leads: bool = False
) -> WeightStream:
    """What a publication to ``engine`` sends: the LoRA adapter alone for an engine that serves adapters
    (``engine.publishes_adapter``; small, read as it is), else θ's full tensors streamed in the engine's serving
    dtype (``engine.serving_dtype``) after the optimizer step's kernels (:class:`PublishedWeights`).

    Args:
        policy: The model the engine serves.
        engine: The rollout engine.
        placement: Where the policy's parameters live (the run's placement gathers each full tensor).
        leads: This rank publishes for ranks that follow it (see :func:`publish_to_shared_servers`).
    """
    if bool(getattr(engine, "publishes_adapter", False)):
        return WeightStream.of(adapter_state_dict(policy))
    ready = step_completion(_device_of(policy))  # recorded now, right after the step was queued
    return PublishedWeights(policy, placement, getattr(engine, "serving_dtype", None), ready, leads)


def hand_over_weights(engine: Any, weights: Mapping[str, torch.Tensor] | WeightStream, version: int) -> PublishReceipt:
    """``engine.publish`` with what it takes: the stream itself where it accepts one (``accepts_weight_stream``, as
    tslightning's engines do), else a plain state dict of the full tensors, gathered in one pass (an engine written
    against ``publish(state_dict, version)`` may ``load_state_dict`` it)."""
    if isinstance(weights, WeightStream) and not getattr(engine, "accepts_weight_stream", False):
        weights = dict(iter(weights))
    return engine.publish(weights, version)


def _device_of(policy: torch.nn.Module) -> torch.device:
    return next(policy.parameters()).device


def _finish(weights: Mapping[str, torch.Tensor] | WeightStream) -> None:
    if isinstance(weights, PublishedWeights):
        weights.finish()


def _follow(weights: Mapping[str, torch.Tensor] | WeightStream) -> None:
    if isinstance(weights, PublishedWeights):
        weights.follow()


def _checked(receipt: PublishReceipt, version: int) -> PublishReceipt:
    if receipt.policy_version != version:
        raise RolloutEngineError(
            f"published θ_{version} but the engine acknowledged version {receipt.policy_version}; its replicas "
            "may serve another policy: close the engine and start another"
        )
    return receipt


def publishable_state_dict(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full weights a replica serves, as a state dict: ``policy.state_dict()``, with a peft model's LoRA adapters
    merged layer by layer (:func:`~tslightning.callbacks.published_weights.merged_lora_tensors`; the trained model
    keeps its adapters). For exports and checks; publication streams them instead (:func:`publication_weights`).
    """
    from peft import PeftModel

    if isinstance(policy, PeftModel):
        return dict(merged_lora_tensors(policy))
    return policy.state_dict()


def adapter_state_dict(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A peft policy's LoRA adapter in peft's saved format (``...q_proj.lora_A.weight``), detached, not copied.

    Raises:
        ValueError: If ``policy`` is not a peft model (set ``model.lora`` to train an adapter).
    """
    from peft import PeftModel, get_peft_model_state_dict

    if not isinstance(policy, PeftModel):
        raise ValueError(
            f"the rollout engine serves LoRA adapters, but the policy is a {type(policy).__name__}, not a peft model: "
            "set model.lora, or start the servers without an adapter"
        )
    return {name: tensor.detach() for name, tensor in get_peft_model_state_dict(policy).items()}


def _wait_for(publish: Callable[[], PublishReceipt], timeout_s: float | None, version: int) -> PublishReceipt:
    """Run ``publish``, failing after ``timeout_s`` seconds (a daemon thread, so a hung engine cannot block exit)."""
    if timeout_s is None:
        return publish()
    future: Future[PublishReceipt] = Future()

    def run() -> None:
        try:
            future.set_result(publish())
        except BaseException as exc:
            future.set_exception(exc)

    Thread(target=run, name=f"publish-policy-{version}", daemon=True).start()
    try:
        return future.result(timeout_s)
    except TimeoutError:
        raise RolloutEngineError(
            f"rollout replicas did not acknowledge θ_{version} within timeout_s={timeout_s} s; they may now serve "
            "mixed versions: close the engine and start another"
        ) from None
