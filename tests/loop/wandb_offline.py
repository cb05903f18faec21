"""Reading a W&B offline run back (``run-<id>.wandb``): what the run logged, step by step.

Imported as ``from wandb_offline import history``: there is no ``__init__.py`` here, so pytest puts this directory on
``sys.path``. wandb 0.31 writes the file from its Go core and ships no Python reader; the format is its datastore's: a
7-byte header (``:W&B``, magic, version), then 32 KiB blocks of records, each a 7-byte header (CRC-32, length, kind:
1 full, 2 first, 3 middle, 4 last) and a chunk of a serialized ``wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

_BLOCK = 32768
_HEADER = struct.Struct("<4sHB")
_RECORD = struct.Struct("<IHB")


def history(run_file: Path, key: str) -> list[tuple[int, float]]:
    """``(trainer/global_step, value)`` of every history row of the run that logged ``key``."""
    rows = []
    for record in _records(Path(run_file).read_bytes()):
        if record.WhichOneof("record_type") != "history":
            continue
        items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        if key in items:
            rows.append((int(items["trainer/global_step"]), float(items[key])))
    return rows


def _records(data: bytes) -> Iterator:
    from wandb.proto import wandb_internal_pb2

    assert _HEADER.unpack(data[: _HEADER.size])[0] == b":W&B", "not a W&B run file"
    position, pending = _HEADER.size, b""
    while position + _RECORD.size <= len(data):
        if _BLOCK - position % _BLOCK < _RECORD.size:  # a block's tail too short for a header is padding
            position += _BLOCK - position % _BLOCK
            continue
        _, length, kind = _RECORD.unpack(data[position : position + _RECORD.size])
        if kind == 0 and length == 0:
            return
        position += _RECORD.size
        pending += data[position : position + length]
        position += length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record
