"""Read back what wandb wrote in offline mode: the records of a run's `run-<id>.wandb` file (wandb's transaction
log: a 7-byte header, then LevelDB log blocks of 32 KiB holding protobuf `Record`s, which wandb's own package
defines; wandb no longer ships a Python reader of the file)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

_BLOCK = 32 * 1024
_HEADER = 7            # ":W&B", magic 0xBEE1, version
_RECORD_HEADER = 7     # crc32 (4), length (2), type (1)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a wandb transaction log")
    out, pending, pos = [], b"", _HEADER
    while pos + _RECORD_HEADER <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < _RECORD_HEADER:  # block trailer: padding
            pos += room
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += room
            continue
        chunk = data[pos + _RECORD_HEADER: pos + _RECORD_HEADER + length]
        pos += _RECORD_HEADER + length
        if kind == _FULL:
            out.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            out.append(pending + chunk)
            pending = b""
    return out


def read_run(path: str | Path) -> dict:
    """{"run_id", "config": {key: value}, "history": {step: {key: value}}} of one offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2 as pb

    run: dict = {"run_id": None, "config": {}, "history": {}}
    for payload in _payloads(Path(path).read_bytes()):
        rec = pb.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run["run_id"] = rec.run.run_id
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in rec.config.update})
        elif kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            step = int(items.pop("_step", rec.history.step.num))
            run["history"].setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return run


def offline_runs(wandb_dir: str | Path) -> list[Path]:
    """The .wandb files of every offline run under WANDB_DIR, oldest first."""
    return sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
