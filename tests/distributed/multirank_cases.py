"""Several learner ranks through Fabric: the cases ``test_multirank.py`` launches as one script per strategy.

Run as ``python tests/distributed/multirank_cases.py OUT STRATEGY CASE...`` (Fabric's launcher re-runs this command
line for rank 1). Every rank replays the same synthetic logical batches, streams only the sources
:mod:`tslightning.distributed.rank_assignment` gives it, takes the barrier and saves, per update, the batch direction
and its parameters to ``OUT/<case>/rank<r>.pt``. :func:`run_case` with ``fabric=None`` is the single-process reference
the test computes in its own process.

Cases: ``<objective>-<schedule>`` (``grpo-sync``, ``opd-thundersync``, ...), optionally followed by ``-sharded``
(``shard_statistics``), ``-spread`` (GRPO groups dealt over the ranks by trajectory), ``-odd`` (an MLP width of
255: FSDP2 pads its shards), ``-cap1`` (``group_admission_cap=1``), ``-queue`` (``fold_queue_depth=2``),
``-deep`` (12 decoder layers), ``-whole`` (one gradient unit: the whole gradient at once), ``-lora`` (peft LoRA
adapters on q/v, each an FSDP2 unit of its own), ``-backlog`` (items fed in runs ready at once, ``ingest_ready``:
padded passes of up to 4 sequences) and an advantage estimator
(``grpo-thundersync-sharded-odd-rloo``); ``fail-ingest`` (rank 1 raises in the
middle of its stream: every rank must raise RankFailureError with its parameters unchanged); ``die-ingest`` (rank 1
exits mid-stream: rank 0 must raise RankFailureError within the process group's timeout; run it last);
``publish-every-rank`` (each rank publishes θ_{k+1} to its own engine; rank 1's fails at version 2);
``publish-shared`` (the ranks' engines share servers: rank 0's publishes, rank 1's follows; rank 0's fails at 3);
``publish-sharded`` (sharded parameters, shared servers: rank 0 streams θ to two servers in bfloat16, one gathered
tensor at a time, while rank 1 joins each gather), ``publish-sharded-lora`` (the same with LoRA adapters merged from
gathered factors).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch

from tslightning.core.replay_batches import WorkloadShape, synthetic_grpo_batch, synthetic_opd_batch
from tslightning.distributed.rank_assignment import split_replay_batch
from tslightning.distributed.rank_failure import RankFailureError, reported_to_ranks
from tslightning.distributed.zero_gradients import gathered_parameters
from tslightning.learner.precision import compute_norms_in_float64
from tslightning.learner.streaming_module import OptimizerSettings, StreamingPolicyModule
from tslightning.models.tiny_model import TinyModelConfig, build_tiny_model, build_tokenizer

DEEP_LAYERS = 12
"""Decoder layers of the ``-deep`` policy (the memory measurement: many units, none dominant)."""
SHAPE = WorkloadShape(num_groups=5, group_size=3, max_turns=2, prompt_tokens=(4, 10), observation_tokens=(2, 6))
UPDATES = 2
TIMEOUT_S = int(os.environ.get("MULTIRANK_TIMEOUT_S", "30"))
"""Process-group timeout of the cases (seconds); a loaded machine running them locally may raise it."""
DTYPES = {
    "ddp": torch.float64,
    "fsdp": torch.float64,
    "deepspeed_stage_2": torch.float32,
    "deepspeed_stage_3": torch.float32,
}
"""DeepSpeed computes in at most float32 (its engine's model dtype; ZeRO reduce-scatters fp16/bf16/fp32 only)."""


def make_batches(objective: str, dtype: torch.dtype) -> list:
    """The logical batches of one case: identical on every rank and in the single-process reference."""
    tokenizer = build_tokenizer()
    vocab = build_tiny_model(TinyModelConfig(seed=0), tokenizer).config.vocab_size
    generator = torch.Generator().manual_seed(17)
    if objective == "grpo":
        return [synthetic_grpo_batch(vocab, k, generator, SHAPE) for k in range(UPDATES)]
    teacher = _in_dtype(build_tiny_model(TinyModelConfig(seed=1), tokenizer), torch.float64)
    return [synthetic_opd_batch(vocab, k, generator, teacher, SHAPE) for k in range(UPDATES)]


def make_policy(
    dtype: torch.dtype, intermediate_size: int = 256, layers: int = 2, lora: bool = False
) -> torch.nn.Module:
    config = TinyModelConfig(seed=0, intermediate_size=intermediate_size, num_hidden_layers=layers)
    policy = _in_dtype(build_tiny_model(config, build_tokenizer()), dtype)
    if not lora:
        return policy
    from peft import LoraConfig, get_peft_model

    adapters = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(3)  # the adapters' initial values: the same on every rank and in the reference
    return get_peft_model(policy, adapters)


def _in_dtype(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    model = model.to(dtype)
    if dtype == torch.float64:
        compute_norms_in_float64(model)
    return model


def run_case(case: str, fabric=None, dtype: torch.dtype = torch.float64) -> dict:
    """Replay the case's batches on this rank (all of them when ``fabric`` is ``None``); what the test compares."""
    objective, schedule, *options = case.split("-")
    sharded = "sharded" in options
    flags = ("sharded", "spread", "odd", "cap1", "queue", "deep", "whole", "lora", "backlog")
    advantage = next((option for option in options if option not in flags), "grpo")
    rank, world_size = (0, 1) if fabric is None else (fabric.global_rank, fabric.world_size)
    module = StreamingPolicyModule(
        make_policy(
            dtype, 255 if "odd" in options else 256, DEEP_LAYERS if "deep" in options else 2, "lora" in options
        ),
        objective,
        schedule,
        advantage,
        optimizer=OptimizerSettings(lr=1e-3),
        accumulator_dtype=dtype,
        shard_statistics=sharded,
        group_admission_cap=1 if "cap1" in options else None,
        fold_queue_depth=2 if "queue" in options else 0,
        micro_batch_size=4,
    )
    if "whole" in options:  # one gradient unit: the whole gradient at once, as the learner held it before units
        module.layout.units = [list(range(len(module.layout.parameters)))]
    theta0 = module.layout.values()
    optimizer = _set_up(fabric, module) if fabric is not None else module.configure_optimizers()
    record = {"theta0": theta0, "directions": [], "thetas": [], "units_per_rank": [], "lockstep": [], "held": []}
    record["passes"] = []
    for k, batch in enumerate(make_batches(objective, dtype)):
        assignment, shares = split_replay_batch(batch, world_size, spread="spread" in options)
        share = shares[rank]
        if schedule == "thundersync":
            share = share.reordered(torch.Generator().manual_seed(100 * k + rank))
        if "backlog" in options:  # runs of 1-5 items ready at once, served in padded passes
            for run in backlog_runs(share, torch.Generator().manual_seed(7 * k + rank)):
                module.ingest_ready(run)
        else:
            for item in share.stream():
                module.ingest(item)
        record["passes"].append((len({(r.start, r.end) for r in module.service_log}), len(module.service_log)))
        lockstep = module.lockstep
        module.barrier(optimizer)
        if lockstep is not None:
            record["lockstep"].append((lockstep.ticks, lockstep.idle_passes, module.last_update.num_sources))
        direction = module.last_direction if module.shards is None else module.shards.gather(module.last_direction)
        record["directions"].append(direction.double())
        shard_numel = module.layout.numel if module.shards is None else module.shards.layout.numel
        record["held"].append((module.last_update.peak_held_numel, shard_numel, module.layout.numel))
        record["thetas"].append(full_values(module))
        record["units_per_rank"].append(assignment.units_per_rank())
    record["peak_unit_numel"] = module.placement.units.peak_live_numel
    record["peak_exchange_numel"] = getattr(module.shards, "peak_exchange_numel", None)
    return record


def failing_case(case: str, fabric, dtype: torch.dtype) -> dict:
    """Rank 1 fails in the middle of its share of update 0 (raises, or exits when ``case`` is ``die-ingest``; under
    ``fail-pass-sharded``, with sharded statistics, its pass raises in the middle of its backward, folding a unit's
    first ring step)."""
    module = StreamingPolicyModule(make_policy(dtype), "grpo", "thundersync", shard_statistics="sharded" in case)
    theta0 = module.layout.values()
    optimizer = _set_up(fabric, module)
    share = split_replay_batch(make_batches("grpo", torch.float64)[0], fabric.world_size)[1][fabric.global_rank]
    items = list(share.stream())
    if case == "fail-pass-sharded" and fabric.global_rank == 1:
        exchange, fold, exchanged = module.shards.exchange_unit, module.shards.fold_received, []

        def counted(*args, **kwargs) -> None:
            exchanged.append(args[1])
            exchange(*args, **kwargs)

        def fold_then_fail(contribution, unit, row) -> None:
            if len(exchanged) == len(module.layout.units) + 2:  # second pass, second unit, mid-ring
                raise RuntimeError("injected failure in a pass")
            fold(contribution, unit, row)

        module.shards.exchange_unit, module.shards.fold_received = counted, fold_then_fail
    start = time.perf_counter()
    try:
        with reported_to_ranks(0):
            for position, item in enumerate(items):
                if fabric.global_rank == 1 and position == len(items) // 2:
                    if case == "die-ingest":
                        os._exit(3)  # the process is gone: no agreement, no goodbye
                    raise RuntimeError("injected failure while ingesting")
                module.ingest(item)
        module.barrier(optimizer)
        error = None
    except RankFailureError as exc:
        error = exc
    seconds = time.perf_counter() - start
    # a ZeRO-3 or FSDP gather needs the peer, which is gone after die-ingest (run die-ingest under ddp only)
    unchanged = torch.equal(full_values(module), theta0)
    return {
        "error_type": type(error).__name__,
        "error": str(error),
        "cause": repr(error.__cause__) if error is not None else None,
        "seconds": seconds,
        "unchanged": unchanged,
        "policy_version": module.policy_version,
    }


class _RankEngine:
    """A rollout engine of one rank: records published versions; rank 1's refuses version 2."""

    def __init__(self, rank: int) -> None:
        self.rank, self.policy_version, self.versions = rank, 0, []

    def publish(self, state_dict, policy_version: int):
        from tslightning.rollout.engine import PublishReceipt, RolloutEngineError

        if self.rank == 1 and policy_version == 2:
            raise RolloutEngineError("replica of rank 1 did not acknowledge")
        self.versions.append(policy_version)
        self.policy_version = policy_version
        return PublishReceipt(policy_version, replicas=1, seconds=0.0)


def publishing_case(fabric) -> dict:
    from types import SimpleNamespace

    from tslightning.callbacks import WeightPublisher
    from tslightning.core.sources import BatchClosed

    engine = _RankEngine(fabric.global_rank)
    publisher = WeightPublisher(engine, every_rank=True)
    errors = []
    for version in (1, 2):
        module = SimpleNamespace(policy=torch.nn.Linear(2, 2), policy_version=version, update_timings={})
        try:
            publisher.on_train_batch_end(fabric, module, None, BatchClosed(version - 1), version - 1)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return {"versions": engine.versions, "errors": errors}


class _SharedEngine:
    """One rank's engine on servers every rank shares: rank 0's records what it publishes (and fails at version 3),
    rank 1's what it follows, and fails if asked to publish."""

    shared_servers = True
    accepts_weight_stream = True

    def __init__(self, rank: int) -> None:
        self.rank, self.policy_version, self.published, self.followed = rank, 0, [], []

    def publish(self, state_dict, policy_version: int):
        from tslightning.rollout.engine import PublishReceipt, RolloutEngineError

        assert self.rank == 0, "a follower's engine published"
        if policy_version == 3:
            raise RolloutEngineError("the server did not acknowledge θ_3")
        self.published.append((policy_version, sorted(state_dict.names())))
        self.policy_version = policy_version
        return PublishReceipt(policy_version, replicas=2, seconds=0.0)

    def served(self):
        from tslightning.rollout.vllm_server.engine import ServedVersion

        return ServedVersion(self.policy_version, None, {0: "http://a:1", 1: f"http://b:{self.policy_version}"})

    def follow(self, served) -> None:
        self.followed.append((served.policy_version, served.urls))
        self.policy_version = served.policy_version


def shared_publishing_case(fabric) -> dict:
    from types import SimpleNamespace

    from tslightning.callbacks import WeightPublisher
    from tslightning.core.sources import BatchClosed

    engine = _SharedEngine(fabric.global_rank)
    publisher = WeightPublisher(engine, every_rank=True)
    errors = []
    for version in (1, 2, 3):
        module = SimpleNamespace(policy=torch.nn.Linear(2, 2), policy_version=version, update_timings={})
        try:
            publisher.on_train_batch_end(fabric, module, None, BatchClosed(version - 1), version - 1)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return {"published": engine.published, "followed": engine.followed, "errors": errors}


class _TwoServerEngine:
    """Rank 0's engine streams every publication to two servers (two passes over the weights), in bfloat16."""

    shared_servers = True
    serving_dtype = torch.bfloat16
    accepts_weight_stream = True

    def __init__(self, rank: int) -> None:
        self.rank, self.policy_version, self.passes = rank, 0, []

    def publish(self, weights, policy_version: int):
        from tslightning.rollout.engine import PublishReceipt

        for _server in range(2):
            self.passes.append({name: tensor.detach().cpu().clone() for name, tensor in weights.items()})
        self.policy_version = policy_version
        return PublishReceipt(policy_version, replicas=2, seconds=0.0)

    def served(self):
        from tslightning.rollout.vllm_server.engine import ServedVersion

        return ServedVersion(self.policy_version, None, {0: "http://a:1", 1: "http://b:1"})

    def follow(self, served) -> None:
        self.policy_version = served.policy_version


def sharded_publishing_case(fabric, dtype: torch.dtype, lora: bool = False) -> dict:
    """Publication of a sharded policy to shared servers: what rank 0's two servers received, and every parameter
    gathered independently (``gathered_parameters`` / ``full_tensor``) on every rank; with ``lora``, a peft policy
    whose servers get W + (α/r)·B·A under the base model's names (:func:`merged_reference`)."""
    from types import SimpleNamespace

    from torch.distributed.tensor import DTensor

    from tslightning.callbacks import WeightPublisher
    from tslightning.core.sources import BatchClosed

    module = StreamingPolicyModule(make_policy(dtype, lora=lora), "grpo", "thundersync", accumulator_dtype=dtype)
    _set_up(fabric, module)
    engine = _TwoServerEngine(fabric.global_rank)
    host = SimpleNamespace(policy=module.policy, policy_version=1, update_timings={})
    WeightPublisher(engine, every_rank=True).on_train_batch_end(fabric, host, None, BatchClosed(0), 0)
    with gathered_parameters(module.policy):
        expected = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for name, p in module.policy.named_parameters()
        }
    names = list(module.policy.state_dict().keys())
    if lora:
        adapters = module.policy.peft_config["default"]
        expected = merged_reference(expected, adapters.lora_alpha / adapters.r)
        base = module.policy.get_base_model().state_dict()
        names = [name.replace(".base_layer.", ".") for name in base if ".lora_" not in name]
    return {"passes": engine.passes, "expected": expected, "names": names, "version": engine.policy_version}


def merged_reference(full: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The merged weights a LoRA policy's servers serve, from its gathered parameters ``full``: each adapted
    ``base_layer.weight`` plus scaling·B·A, under the base model's names, adapters left out."""
    merged = {}
    for name, tensor in full.items():
        if ".lora_" in name:
            continue
        layer, base, parameter = name.rpartition(".base_layer.")
        if base and parameter == "weight":
            a, b = full[f"{layer}.lora_A.default.weight"], full[f"{layer}.lora_B.default.weight"]
            tensor = tensor + (b @ a) * scaling
        merged[name.replace(".base_layer.", ".").removeprefix("base_model.model.")] = tensor
    return merged


def backlog_runs(batch, generator: torch.Generator) -> list[list]:
    """The batch's plan alone, then its items in runs of 1 to 5 ready at once."""
    items, runs = list(batch.items), [[batch.plan]]
    while items:
        size = int(torch.randint(1, 6, (1,), generator=generator))
        runs.append(items[:size])
        items = items[size:]
    return runs


def _set_up(fabric, module: StreamingPolicyModule):
    """Fabric set-up of the module and its optimizer (FSDP2 replaces the parameters: optimizer after the module)."""
    from lightning.fabric.strategies import ModelParallelStrategy

    if isinstance(fabric.strategy, ModelParallelStrategy):
        fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(module.configure_optimizers())
        module._fabric_optimizers = [optimizer]  # as fabric.setup links them (fit's _set_up does too)
        return optimizer
    return fabric.setup(module, module.configure_optimizers())[1]


def full_values(module: StreamingPolicyModule) -> torch.Tensor:
    """The whole θ on every rank (a collective under ZeRO-3 and FSDP2)."""
    from torch.distributed.tensor import DTensor

    with gathered_parameters(module.policy):
        return torch.cat(
            [
                (p.full_tensor() if isinstance(p, DTensor) else p).detach().reshape(-1).to("cpu", torch.float64)
                for p in module.layout.parameters
            ]
        )


def _strategy(name: str, devices: int = 2):
    timeout = timedelta(seconds=TIMEOUT_S)
    if name == "fsdp":
        from tslightning.distributed.learner_strategy import LearnerSettings, learner_strategy

        return learner_strategy(LearnerSettings(devices=devices, strategy="fsdp", timeout_s=TIMEOUT_S), "cpu")
    if name == "ddp":
        from lightning.fabric.strategies import DDPStrategy

        return DDPStrategy(process_group_backend="gloo", timeout=timeout)
    from tslightning.distributed.deepspeed_cpu import CPUDeepSpeedStrategy

    return CPUDeepSpeedStrategy(stage=int(name[-1]), timeout=timeout)


def main(out: str, strategy: str, *cases: str) -> None:
    """``STRATEGY`` may name a rank count, ``fsdp:1`` (default 2 ranks); results go under ``OUT/STRATEGY``."""
    import lightning as L

    name, _, devices = strategy.partition(":")
    devices = int(devices or 2)
    fabric = L.Fabric(accelerator="cpu", devices=devices, strategy=_strategy(name, devices))
    fabric.launch()
    for case in cases:
        target = Path(out) / strategy / case
        target.mkdir(parents=True, exist_ok=True)
        try:
            if case.endswith("-ingest") or case.startswith("fail-"):
                record = failing_case(case, fabric, DTYPES[name])
            elif case == "publish-every-rank":
                record = publishing_case(fabric)
            elif case == "publish-shared":
                record = shared_publishing_case(fabric)
            elif case.startswith("publish-sharded"):
                record = sharded_publishing_case(fabric, DTYPES[strategy], lora=case.endswith("-lora"))
            else:
                record = run_case(case, fabric, DTYPES[name])
        except Exception:
            record = {"crash": traceback.format_exc()}
        torch.save(record, target / f"rank{fabric.global_rank}.pt")
        print(f"rank {fabric.global_rank}: {strategy} {case} done", flush=True)
    _tear_down(cases)


def _tear_down(cases: tuple[str, ...]) -> None:
    """Leave together: a barrier, then the process group destroyed on every rank before the interpreter exits.

    Left to interpreter shutdown, the gloo group's native threads can be destroyed while still joinable
    (``terminate called without an active exception``, exit -6) when one rank exits while its peer is still
    tearing down. After ``die-ingest`` the peer is gone, so there is nothing to leave together with.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or "die-ingest" in cases:
        return
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
