"""Checksums of checkpoint files, so that nothing corrupt is ever loaded.

Every rank computes the crc32 (zlib, streamed in 8 MiB blocks: about a second per GB on one core, in the save's
background thread) of each file it is responsible for (its DCP shards; rank 0 also the index, meta.json and
config.yaml) once the file is durable, before it is uploaded; the COMPLETE marker records them all
(`"checksum": "crc32"`, `"checksums": {file: "8 hex digits"}`). Before a checkpoint is loaded its files are read
and compared: a checkpoint folder on a shared file system by all ranks together (file i by rank i mod world size),
a downloaded copy by the node's local rank 0 as it downloads. A mismatch is a `CorruptCheckpoint` naming the file.
Checkpoints written before checksums existed carry none and are loaded as before (sizes only).
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Iterable, Optional

from ..errors import CheckpointError
from .collectives import Collectives

CHECKSUM = "crc32"
_BLOCK = 8 << 20


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files do not match the checksums its marker records."""


def file_crc32(path: str | os.PathLike) -> str:
    """The crc32 of a file's bytes, as 8 hex digits."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            crc = zlib.crc32(view[:n], crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def checksums(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """{file name: crc32} of files in `folder`."""
    return {n: file_crc32(folder / n) for n in sorted(names)}


def recorded(marker: Optional[dict]) -> dict[str, str]:
    """The checksums a marker records ({} for a checkpoint written without them)."""
    if not marker or marker.get("checksum") != CHECKSUM:
        return {}
    sums = marker.get("checksums")
    return dict(sums) if isinstance(sums, dict) else {}


def check_files(folder: Path, expected: dict[str, str], names: Iterable[str]) -> Optional[str]:
    """None when every named file in `folder` has its expected checksum, else what is wrong with the first that
    does not."""
    for n in names:
        path = folder / n
        try:
            got = file_crc32(path)
        except OSError as e:
            return f"{n} cannot be read ({e})"
        if got != expected[n]:
            return f"{n} has crc32 {got}, the marker says {expected[n]} (bytes changed after it was written)"
    return None


def verify_local(folder: Path, marker: Optional[dict], coll: Collectives, shared: bool, url: str) -> None:
    """Compare a checkpoint's files in `folder` with its marker's checksums (a collective).

    shared: every rank sees the same folder (split the files among all ranks); else each node holds its own copy
    (its local rank 0 checks all of it). CorruptCheckpoint on every rank when any file differs.
    """
    expected = recorded(marker)
    problem: Optional[str] = None
    if expected:
        names = sorted(expected)
        if shared:
            problem = check_files(folder, expected, names[coll.rank::coll.world_size])
        elif coll.local_rank == 0:
            problem = check_files(folder, expected, names)
    ok, error = coll.agree(problem is None, problem or "")
    if not ok:
        raise CorruptCheckpoint(f"checkpoint {url} is corrupt: {error}")
