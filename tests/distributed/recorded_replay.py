"""A ``tslightning fit`` run in a subprocess and the batch-synchronous replay of what it recorded
(``--record_batches true``): the reference a run's parameters are compared with (App. G protocol, across ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from tslightning.core.batch_registry import BatchPlan
from tslightning.core.sources import BatchClosed
from tslightning.learner.settings import OptimizerSettings
from tslightning.learner.streaming_module import StreamingPolicyModule
from tslightning.loop.batch_recording import load_batches
from tslightning.models.tiny_model import load_tiny_model

ROOT = Path(__file__).parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def run_fit(out: Path, *options: str, config: Path = QUICKSTART, timeout: float = 600) -> None:
    """``tslightning fit --config config`` into ``out`` (no progress bar, one thread per rank), asserting it exits 0;
    this directory is on the ranks' ``PYTHONPATH`` for callbacks defined beside the tests (``ParameterDump``)."""
    command = [sys.executable, "-m", "tslightning.cli", "fit", "--config", str(config)]
    command += ["--progress", "false", "--out_dir", str(out), *options]
    pythonpath = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def dump_parameters(out: Path) -> list[str]:
    """The ``--callbacks`` option that has every rank save its final parameters to ``out/theta-rank{r}.pt``."""
    dump = {"class_path": "parameter_dump.ParameterDump", "init_args": {"path": str(out)}}
    return ["--callbacks", json.dumps([dump])]


def trace(out: Path, rank: int = 0, record: str | None = None) -> list[dict]:
    """Rank ``rank``'s release-trace entries (only those of kind ``record`` when given)."""
    lines = (out / "trace" / f"trace-rank{rank}.jsonl").read_text().splitlines()
    return [entry for entry in map(json.loads, lines) if record is None or entry["record"] == record]


def sync_replay_of_every_rank(
    out: Path, updates: int, dtype: torch.dtype = torch.float32, config_path: Path = QUICKSTART
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """θ after ``updates`` sync updates in one process on the union of every rank's recorded batches (from
    ``out/batches``; one rank's alone for a one-rank run), starting from ``out/policy-0`` in ``dtype`` with the
    objective, optimizer and clipping of the run's config ``config_path``; and that θ_0."""
    config = yaml.safe_load(config_path.read_text())
    policy, _ = load_tiny_model(out / "policy-0")
    policy = policy.to(dtype)
    initial = {name: tensor.clone() for name, tensor in policy.state_dict().items()}
    algorithm = config["algorithm"]
    settings = OptimizerSettings(**{**algorithm["optimizer"], "betas": tuple(algorithm["optimizer"]["betas"])})
    module = StreamingPolicyModule(
        policy, config["objective"], "sync", max_grad_norm=algorithm["max_grad_norm"], optimizer=settings
    )
    optimizer = module.configure_optimizers()
    for update in range(updates):
        ranks = load_batches(out / "batches", update)
        plans = [items[0] for items in ranks.values()]
        groups = {g: m for plan in plans for g, m in plan.group_sizes.items()}
        module.ingest(BatchPlan(plans[0].objective, plans[0].policy_version, groups))
        for items in ranks.values():
            for item in items[1:]:
                if not isinstance(item, BatchClosed):
                    module.ingest(item)
        module.ingest(BatchClosed(plans[0].policy_version))
        module.barrier(optimizer)
    return {name: tensor.detach() for name, tensor in policy.state_dict().items()}, initial


def relative_gap(fitted: dict[str, torch.Tensor], replayed: dict[str, torch.Tensor], initial: dict) -> float:
    """‖θ_run − θ_replay‖ / ‖θ_run − θ_0‖ over every parameter, in float64 (Eq. 30's gap relative to the step);
    asserts the run moved at all, so a run that trained nothing cannot pass."""
    names = sorted(fitted)
    run, replay, start = (torch.cat([s[n].flatten().double() for n in names]) for s in (fitted, replayed, initial))
    moved = float((run - start).norm())
    assert moved > 0, "the run did not move the parameters"
    return float((replay - run).norm()) / moved


FLOAT32_TOLERANCE = 1e-4
"""A float32 run's parameter gap to the float64 sync replay, relative to the step, that always passes."""
FLOAT32_FLOOR_FACTOR = 5
"""Above that, the gap may be this many times float32 arithmetic's own floor on the same batches."""


def assert_float32_run_is_sync(
    fitted: dict[str, torch.Tensor], out: Path, updates: int, config_path: Path = QUICKSTART
) -> float:
    """Assert the float32 run's θ ``fitted`` is the batch-synchronous update of its recorded batches; returns the gap.

    The reference is the float64 sync replay (exact). A float32 computation cannot land closer than float32's floor
    on these batches, measured as the float32 sync replay's own gap to the float64 one: AdamW's first steps divide by
    ``|g| + ε``, so entries whose contributions cancel (group-normalised advantages sum to zero) turn rounding into
    relative gaps near 1e-4 of the step. The run passes within ``FLOAT32_TOLERANCE`` or ``FLOAT32_FLOOR_FACTOR`` × that
    floor; a wrong update (a source lost, doubled or stale) is off by orders of magnitude more."""
    exact, initial = sync_replay_of_every_rank(out, updates, torch.float64, config_path)
    float32, _ = sync_replay_of_every_rank(out, updates, torch.float32, config_path)
    gap, floor = relative_gap(fitted, exact, initial), relative_gap(float32, exact, initial)
    bound = max(FLOAT32_TOLERANCE, FLOAT32_FLOOR_FACTOR * floor)
    assert gap <= bound, f"‖θ_run − θ_sync‖ / step = {gap:.3e} > {bound:.3e} (float32 sync replay: {floor:.3e})"
    return gap
