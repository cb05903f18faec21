"""A run's output directory: claimed only after every check passed, and never written over unless asked.

A fresh run needs an ``out_dir`` that holds none of the files ``fit`` writes (:data:`RUN_OUTPUTS`; other files are
left alone). ``--overwrite`` removes those first — and the ``update-<k>`` checkpoints of a ``checkpoint.dirpath``
outside it — so nothing of the earlier run mixes into the new one; ``--resume`` continues the run in place. Each
segment of a run — the first, then each resume — records its own resolved config and rewards (``config.yaml`` and
``rewards.json``, then ``config.resume-<n>.yaml`` and ``rewards.resume-<n>.json``), so a resume adds to the run and
replaces none of its records.

With several learner ranks, global rank 0 claims the directory; the ranks a launcher started (Fabric's re-launched
ranks, torchrun, SLURM) use it as rank 0 left it.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tslightning.loop.run_config import PlainData, config_yaml

RUN_OUTPUTS = (
    "config.yaml",
    "config.resume-*.yaml",
    "config.json",
    "rewards.json",
    "rewards.resume-*.json",
    "timeline.png",
    "csv",
    "tensorboard",
    "wandb",
    "mlruns",
    "trace",
    "checkpoints",
    "policy-0",
    "teacher-0",
    "tiny-model",
    "batches",
)
"""What ``fit`` writes into ``out_dir`` (``config.json``: the resolved config of earlier versions; ``wandb`` and
``mlruns``: the W&B and MLflow loggers' default directories)."""

_CHECKPOINT = re.compile(r"(\.tmp-)?update-\d+")
_RESUME_CONFIG = re.compile(r"config\.resume-(\d+)\.yaml")


@dataclass(frozen=True)
class RunDirectory:
    """Where one segment of a run writes: ``path``, and which segment it is (0: the first; n: the n-th resume)."""

    path: Path
    segment: int = 0

    @property
    def config_file(self) -> Path:
        """This segment's resolved config: ``config.yaml``, or ``config.resume-<n>.yaml`` for the n-th resume."""
        return self.path / ("config.yaml" if self.segment == 0 else f"config.resume-{self.segment}.yaml")

    @property
    def rewards_file(self) -> Path:
        """This segment's rewards and step times: ``rewards.json``, or ``rewards.resume-<n>.json``."""
        return self.path / ("rewards.json" if self.segment == 0 else f"rewards.resume-{self.segment}.json")


def run_directory_problems(
    out_dir: str, resume: str | None, overwrite: bool, checkpoint_dir: str | None = None
) -> list[str]:
    """What keeps this run from writing to ``out_dir`` (and ``checkpoint_dir``) without losing an earlier run."""
    out = Path(out_dir)
    problems = []
    if resume is not None and overwrite:
        problems.append("overwrite replaces the run in out_dir and resume continues it: give one of them")
    if out.exists() and not out.is_dir():
        problems.append(f"out_dir {out} is a file; give a directory")
    if resume is not None or overwrite or launched_rank() != 0:
        return problems
    previous = _run_outputs(out)
    if previous:
        problems.append(
            f"out_dir {out} already holds a run ({', '.join(p.name for p in previous[:4])}): choose a new out_dir, "
            f"continue it with --resume {out}/checkpoints/update-<k>, or replace it with --overwrite true"
        )
    elsewhere = checkpoint_dir is not None and Path(checkpoint_dir).resolve() != (out / "checkpoints").resolve()
    checkpoints = _checkpoints(Path(checkpoint_dir)) if elsewhere else []
    if checkpoints:
        names = ", ".join(p.name for p in checkpoints[:4])
        problems.append(
            f"checkpoint.dirpath {checkpoint_dir} already holds checkpoints ({names}) that this run would prune: "
            "choose another dirpath, continue with --resume, or replace them with --overwrite true"
        )
    return problems


def open_run_directory(
    out_dir: str,
    config: Mapping[str, PlainData],
    resume: str | None = None,
    overwrite: bool = False,
    checkpoint_dir: str | None = None,
) -> RunDirectory:
    """Claim ``out_dir`` for this segment of the run and record its resolved ``config``; call it only after
    :func:`run_directory_problems` found none.

    ``overwrite`` first removes an earlier run's outputs (and the checkpoints in ``checkpoint_dir``). Only global rank
    0 writes; another rank gets the directory rank 0 claimed.
    """
    out = Path(out_dir)
    if launched_rank() != 0:
        return RunDirectory(out)
    if overwrite:
        for path in _run_outputs(out) + (_checkpoints(Path(checkpoint_dir)) if checkpoint_dir else []):
            _remove(path)
    out.mkdir(parents=True, exist_ok=True)
    run = RunDirectory(out, _next_segment(out) if resume is not None else 0)
    header = (
        f"tslightning fit: the resolved config of {out}"
        + (f" (resume {run.segment}, from {resume})" if run.segment else "")
        + f".\nRe-run it: tslightning fit --config {run.config_file} --out_dir NEW_DIR"
    )
    run.config_file.write_text(config_yaml(config, header))
    return run


def launched_rank() -> int:
    """This process's global rank as its launcher set it (``RANK``, ``LOCAL_RANK``, ``SLURM_PROCID``); 0 if none."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0)


def _next_segment(out: Path) -> int:
    """0 for a directory no run wrote a config to yet, else one past the last resume's."""
    if not (out / "config.yaml").exists():
        return 0
    resumes = [int(m.group(1)) for p in out.iterdir() if (m := _RESUME_CONFIG.fullmatch(p.name))]
    return max(resumes, default=0) + 1


def _run_outputs(out: Path) -> list[Path]:
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir() if any(fnmatch.fnmatchcase(p.name, name) for name in RUN_OUTPUTS))


def _checkpoints(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if _CHECKPOINT.fullmatch(p.name))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
