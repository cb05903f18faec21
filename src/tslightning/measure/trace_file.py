"""Release trace files: one JSONL file per learner rank, ``trace-rank{r}.jsonl`` (written by
:class:`~tslightning.callbacks.ReleaseTraceRecorder`, read here by the replay, the timeline and the bench)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

_TRACE_FILE = re.compile(r"trace-rank(\d+)\.jsonl")


def trace_file_name(rank: int) -> str:
    """The name of rank ``rank``'s trace file."""
    return f"trace-rank{rank}.jsonl"


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of one trace file, or of every rank's file in a trace directory (in rank order)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(
            (p for p in path.iterdir() if _TRACE_FILE.fullmatch(p.name)),
            key=lambda p: int(_TRACE_FILE.fullmatch(p.name).group(1)),
        )
    else:
        files = [path]
    return [json.loads(line) for file in files for line in file.read_text().splitlines() if line.strip()]
