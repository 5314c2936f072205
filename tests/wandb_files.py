"""Read W&B's offline run files (`run-<id>.wandb`), to test what a later `wandb sync` would send.

The file is W&B's record log (a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks, each
with a 7-byte header: CRC32, length, type full/first/middle/last) of protobuf `Record`s. W&B no longer
ships a reader, so this is one for tests only.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    out, pos, pending = [], 7, b""
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:  # the rest of a block too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        pos += _CHUNK_HEADER + length
        if kind in (_FULL, _FIRST):
            pending = chunk
        elif kind in (_MIDDLE, _LAST):
            pending += chunk
        else:
            continue
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def complete_records(path: Path, deadline_s: float = 120.0) -> list:
    """The records of a finished run's file. W&B's service writes the file in the background and may
    still be writing after `wandb.finish()` returned: wait (up to a deadline) for its last record,
    `exit`."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            found = records(path)
        except Exception:  # a chunk still being written
            found = []
        if found and found[-1].WhichOneof("record_type") == "exit":
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: W&B did not finish writing it within {deadline_s:g}s")
        time.sleep(0.1)


def run_record(path: Path):
    return next(r.run for r in complete_records(path) if r.WhichOneof("record_type") == "run")


def history(path: Path) -> list[dict]:
    """Each history row as {key: value}."""
    rows = []
    for r in complete_records(path):
        if r.WhichOneof("record_type") == "history":
            rows.append({".".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
    return rows
