"""Which checkpoints exist: the storage a path or URL names, the complete checkpoints there, the newest, which one a
path names, and what a checkpoint says about itself (meta.json, the run's config). Used by resume, loading and
tools/convert2hf.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from ..config.loader import strip_location_prefix
from ..errors import CheckpointError
from ..utils.logging import get_logger
from .s3 import S3Storage
from .storage import CONFIG, MARKER, META, REJECTED, LocalStorage, Storage

logger = get_logger(__name__)


def parse_destination(url: str | os.PathLike, attempts: int = 3, backoff_s: float = 1.0) -> Storage:
    """A local folder or `s3://bucket/prefix` (InternLM's `local:` / `boto3:` prefixes allowed; InternLM's
    `boto3:s3://bucket.ENDPOINT/prefix` names the endpoint in the bucket string)."""
    text = str(url)
    if text.startswith("boto3:s3://"):
        return S3Storage(text, attempts, backoff_s)
    text = strip_location_prefix(text)
    if text.startswith("s3://"):
        return S3Storage(text, attempts, backoff_s)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text):
        raise CheckpointError(f"checkpoint location {text!r}: unsupported scheme; expected a local folder or "
                              "s3://bucket/prefix")
    return LocalStorage(text)


@dataclass
class CheckpointRef:
    """A checkpoint at a destination: `name` is its folder ("10", "snapshot/0", "" for the root itself).
    `marker` is its COMPLETE marker; None only for an incomplete one read on purpose (`allow_incomplete`)."""

    storage: Storage
    name: str
    marker: Optional[dict]

    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def step(self) -> int:
        return int(self.marker["step"]) if self.marker is not None else -1

    @property
    def kind(self) -> str:
        return str(self.marker.get("kind", "regular")) if self.marker is not None else "incomplete"

    @property
    def url(self) -> str:
        return self.storage.child(self.name)

    def files(self) -> dict[str, int]:
        """{file name: size} of the checkpoint: the marker's list, else what is there."""
        if self.marker is not None:
            return dict(self.marker.get("files", {}))
        return self.storage.file_sizes(self.name)


def find_complete_checkpoints(storage: Storage) -> list[CheckpointRef]:
    """Every complete checkpoint under `storage` (regular and snapshot slots), oldest first; incomplete or damaged
    ones are skipped (damaged ones with a warning)."""
    refs = []
    for name in storage.list_names():
        marker = storage.read_marker(name)
        if marker is None:
            rejected = storage.read_text(name, REJECTED)
            if rejected is not None:
                logger.info("checkpoint %s was rejected (%s); ignored", storage.child(name), _reason(rejected))
            else:
                logger.info("checkpoint %s has no %s marker (interrupted while being written); ignored",
                            storage.child(name), MARKER)
            continue
        problem = storage.verify(name, marker)
        if problem:
            logger.warning("checkpoint %s is damaged (%s); ignored", storage.child(name), problem)
            continue
        refs.append(CheckpointRef(storage, name, marker))
    refs.sort(key=lambda r: (r.step, r.kind == "regular"))
    return refs


def _reason(rejected: str) -> str:
    try:
        return str(json.loads(rejected).get("reason", "no reason given"))
    except (ValueError, AttributeError):
        return "unreadable REJECTED file"


def latest_checkpoint(storage: Storage) -> Optional[CheckpointRef]:
    """The newest complete checkpoint under `storage` (the higher step; a regular one over a snapshot of that
    step)."""
    refs = find_complete_checkpoints(storage)
    return refs[-1] if refs else None


def resolve(storage: Storage, *, incomplete: str, nothing: str, allow_incomplete: bool = False) -> CheckpointRef:
    """What `storage`'s root names: itself when it is one checkpoint (it holds the marker), else the newest complete
    checkpoint under it.

    A damaged named checkpoint is a CheckpointError. `incomplete` and `nothing` are the messages ("{url}": the
    root) for a root holding DCP files without a marker (unless `allow_incomplete`: then it is returned) and for
    a root without any complete checkpoint.
    """
    marker = storage.read_marker("")
    if marker is not None:
        problem = storage.verify("", marker)
        if problem:
            raise CheckpointError(f"checkpoint {storage.url} is damaged: {problem}")
        return CheckpointRef(storage, "", marker)
    if storage.holds_dcp_files(""):
        if allow_incomplete:
            return CheckpointRef(storage, "", None)
        raise CheckpointError(incomplete.format(url=storage.url))
    ref = latest_checkpoint(storage)
    if ref is None:
        raise CheckpointError(nothing.format(url=storage.url))
    return ref


@contextlib.contextmanager
def local_checkpoint(path: str | os.PathLike, allow_incomplete: bool = False,
                     download_dir: Optional[str | os.PathLike] = None) -> Iterator[tuple[Path, str]]:
    """A local folder holding the checkpoint `path` names (see `resolve`) and a line saying which it is; one in
    object storage is downloaded into `download_dir` (default a temporary folder, removed afterwards). In one
    process, for tools; boto3 takes the endpoint and credentials from the environment, as for training."""
    storage = parse_destination(path)
    root = storage.local_path("")
    if root is not None and not root.is_dir():
        raise CheckpointError(f"{storage.url}: checkpoint folder not found")
    ref = resolve(storage, allow_incomplete=allow_incomplete,
                  incomplete=("checkpoint {url} has no COMPLETE marker: it was interrupted while being written (or "
                              "not written by train.py); convert an older one, or pass --allow-incomplete"),
                  nothing=("{url}: no complete checkpoint in it (expected a folder written by train.py with a "
                           "COMPLETE marker, or a save_ckpt_folder holding such folders)"))
    folder = storage.local_path(ref.name)
    if not ref.complete:
        which = f"DCP folder without a completion marker (read anyway): {ref.url}"
    elif ref.name and folder is not None:
        which = f"newest complete checkpoint under {storage.url}: step {ref.step} ({ref.kind}): {ref.url}"
    else:
        which = f"checkpoint of step {ref.step}: {ref.url}"
    if folder is not None:
        yield folder, which
        return
    tmp = None if download_dir is not None else tempfile.mkdtemp(prefix="convert2hf-")
    local = Path(download_dir if download_dir is not None else tmp)
    try:
        storage.download(ref.name, ref.files(), local)
        yield local, f"{which} (downloaded to {local})"
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def read_meta(folder: str | os.PathLike) -> dict:
    """The meta.json of a local checkpoint folder; {} when it is absent or unreadable."""
    try:
        meta = json.loads((Path(folder) / META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def checkpoint_config(folder: str | os.PathLike) -> Any:
    """The run's Config recorded in a local checkpoint folder: meta.json's "config" (YAML text), else
    config.yaml."""
    import yaml

    from ..config import build_config, load_config

    folder = Path(folder)
    raw = read_meta(folder).get("config")
    try:
        raw = yaml.safe_load(raw) if isinstance(raw, str) else raw
    except yaml.YAMLError:
        raw = None
    if isinstance(raw, dict):
        return build_config(raw, source=f"{folder / META} (config)")
    if (folder / CONFIG).is_file():
        return load_config(folder / CONFIG)
    raise CheckpointError(f"{folder}: no run config in the checkpoint ({META} with a \"config\" entry, or "
                          f"{CONFIG}); pass --config")
