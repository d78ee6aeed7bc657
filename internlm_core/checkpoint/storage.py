"""Where checkpoints live, behind one interface: `Storage`, with a local folder (`LocalStorage`) and an object store
(`S3Storage` in s3.py, `s3://bucket/prefix`). `catalog.parse_destination` turns a path or URL into one of them.

Layout under a destination (InternLM's: a folder per step, two snapshot slots):

    <save_ckpt_folder>/
      10/                          regular checkpoint of step 10
        .metadata                  DCP's index of every item (read back with a restricted unpickler)
        __0_0.distcp ...           DCP shards, one or more per rank: model, optimizer and all other state
        meta.json                  step, tokens, layout, versions, what resumes exactly, the config text
        config.yaml                the run's resolved config (the same text as in meta.json)
        COMPLETE                   the completion marker, written last (JSON: step, kind, every file with its size
                                   and crc32)
      20/ ...
      snapshot/0/  snapshot/1/     `oss_snapshot_freq`'s two alternating slots, the same inside
      LEASE                        the run that writes here and its last heartbeat (lease.py)

A checkpoint is complete when its marker exists and every file the marker lists is there with its size; it is
loaded only when every file also has its crc32 (integrity.py). A checkpoint found corrupt, or saved during a
loss spike that was rewound, is *rejected*: its marker is replaced by REJECTED (the reason and the old marker),
its files stay for inspection and it no longer counts as complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Callable, Optional, TypeVar

from ..errors import CheckpointError
from ..utils.logging import get_logger
from ..utils.redact import redact_tree

logger = get_logger(__name__)

MARKER = "COMPLETE"
REJECTED = "REJECTED"
LEASE = "LEASE"
META = "meta.json"
CONFIG = "config.yaml"
DCP_METADATA = ".metadata"
SNAPSHOT_SLOTS = ("snapshot/0", "snapshot/1")
STEP_NAME = re.compile(r"^\d+$")
_TRASH = ".trash-"  # replaced checkpoint folders, deleted once the new one is complete

T = TypeVar("T")


def is_checkpoint_name(name: str) -> bool:
    """A regular checkpoint folder (its step number) or one of the two snapshot slots."""
    return bool(STEP_NAME.match(name)) or name in SNAPSHOT_SLOTS


def retry(fn: Callable[[], T], what: str, attempts: int = 3, backoff_s: float = 1.0) -> T:
    """`fn()`, tried `attempts` times with exponential backoff; a CheckpointError naming `what` in the end."""
    last: Optional[BaseException] = None
    for i in range(max(1, attempts)):
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as e:  # network, throttling, a full disk: all worth another try
            last = e
            if i + 1 < attempts:
                delay = backoff_s * (2 ** i)
                logger.warning("%s failed (attempt %d of %d): %s; retrying in %.1f s", what, i + 1, attempts,
                               _describe(e), delay)
                time.sleep(delay)
    raise CheckpointError(f"{what}: failed after {attempts} attempt(s): {_describe(last)}")


def _describe(e: Optional[BaseException]) -> str:
    return f"{type(e).__name__}: {e}" if e is not None else "unknown error"


def fsync_dir(path: Path) -> None:
    """Make the entries of a directory (new, renamed files) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write a file atomically and durably: temporary file, fsync, rename, fsync of the folder."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class Storage(ABC):
    """A run's checkpoints; `name` is a checkpoint's folder relative to the root ("10", "snapshot/0", "" for the
    root itself) and `filename` a file directly inside it."""

    url: str

    def child(self, name: str) -> str:
        """The URL of checkpoint `name`."""
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def local_path(self, name: str) -> Optional[Path]:
        """A folder of this machine's file system that is checkpoint `name`, read and written in place; None when
        the checkpoint is reached through copies only (`upload_file`, `download`)."""
        return None

    @abstractmethod
    def list_names(self) -> list[str]:
        """Names of the checkpoint folders that exist (complete or not)."""

    @abstractmethod
    def read_text(self, name: str, filename: str) -> Optional[str]:
        """A file's text, or None when it does not exist."""

    @abstractmethod
    def file_sizes(self, name: str) -> dict[str, int]:
        """{file name: size in bytes} of every file in a checkpoint folder ({} if it does not exist)."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove a checkpoint: its marker first (so that a half-deleted one counts as incomplete), then the rest."""

    @abstractmethod
    def remove_file(self, name: str, filename: str) -> None:
        """Remove one file of checkpoint `name` (nothing when it is absent)."""

    @abstractmethod
    def upload_file(self, local: Path, name: str, filename: str) -> None:
        """Copy a local file into checkpoint `name` as `filename`."""

    @abstractmethod
    def put_text(self, name: str, filename: str, text: str) -> None:
        """Write a small text file (the marker) into checkpoint `name`, durably and all at once."""

    @abstractmethod
    def download(self, name: str, files: dict[str, int], local_dir: Path) -> None:
        """Every listed file of checkpoint `name` into `local_dir` (skipping ones already there with their size)."""

    def set_aside(self, name: str) -> None:
        """Make way for a new checkpoint `name`: the old one stops counting as complete at once and is gone by the
        next `empty_trash`."""
        self.delete(name)

    def empty_trash(self) -> None:
        """Delete what `set_aside` left for later."""

    def reject(self, name: str, reason: str) -> None:
        """Checkpoint `name` stops counting as complete: REJECTED (the reason and the old marker) is written, then
        the marker removed; the files stay."""
        record = {"reason": reason, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "marker": self.read_marker(name)}
        self.put_text(name, REJECTED, json.dumps(redact_tree(record), indent=1))  # a reason may quote a URL
        self.remove_file(name, MARKER)

    def read_marker(self, name: str) -> Optional[dict]:
        """The COMPLETE marker of checkpoint `name`; None when it is absent or unreadable."""
        text = self.read_text(name, MARKER)
        if text is None:
            return None
        try:
            marker = json.loads(text)
        except json.JSONDecodeError:
            logger.warning("checkpoint %s: unreadable %s marker; treated as incomplete", self.child(name), MARKER)
            return None
        return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None

    def verify(self, name: str, marker: dict) -> Optional[str]:
        """None when every file the marker lists is present with its size, else what is wrong."""
        sizes = self.file_sizes(name)
        for fname, size in sorted(marker.get("files", {}).items()):
            if fname not in sizes:
                return f"{fname} is missing"
            if sizes[fname] != size:
                return f"{fname} has {sizes[fname]} bytes, the marker says {size}"
        if DCP_METADATA not in sizes:
            return f"{DCP_METADATA} is missing"
        return None

    def holds_dcp_files(self, name: str) -> bool:
        """Whether checkpoint `name` has DCP files (its index or shards), complete or not."""
        return any(f == DCP_METADATA or f.endswith(".distcp") for f in self.file_sizes(name))


class LocalStorage(Storage):
    """A folder on a (shared, for several nodes) file system; DCP writes straight into it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = str(self.root)

    def path(self, name: str) -> Path:
        return self.root / name

    def child(self, name: str) -> str:
        return str(self.path(name))

    def local_path(self, name: str) -> Optional[Path]:
        return self.path(name)

    def list_names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        names = [p.name for p in self.root.iterdir() if p.is_dir() and STEP_NAME.match(p.name)]
        names += [s for s in SNAPSHOT_SLOTS if (self.root / s).is_dir()]
        return names

    def read_text(self, name: str, filename: str) -> Optional[str]:
        try:
            return (self.path(name) / filename).read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            return None

    def file_sizes(self, name: str) -> dict[str, int]:
        folder = self.path(name)
        if not folder.is_dir():
            return {}
        return {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}

    def _drop_marker(self, folder: Path) -> None:
        try:
            (folder / MARKER).unlink()
            fsync_dir(folder)
        except FileNotFoundError:
            pass

    def delete(self, name: str) -> None:
        folder = self.path(name)
        self._drop_marker(folder)
        shutil.rmtree(folder, ignore_errors=True)

    def remove_file(self, name: str, filename: str) -> None:
        try:
            (self.path(name) / filename).unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.path(name))

    def upload_file(self, local: Path, name: str, filename: str) -> None:
        dst = self.path(name) / filename
        if Path(local).resolve() == dst.resolve():
            return
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f"{filename}.part{os.getpid()}")
        shutil.copyfile(local, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, dst)
        fsync_dir(dst.parent)

    def put_text(self, name: str, filename: str, text: str) -> None:
        folder = self.path(name)
        folder.mkdir(parents=True, exist_ok=True)
        fsync_dir(folder)  # the files written before this one are durable first
        write_durable(folder / filename, text.encode("utf-8"))

    def download(self, name: str, files: dict[str, int], local_dir: Path) -> None:
        local_dir.mkdir(parents=True, exist_ok=True)
        for fname, size in sorted(files.items()):
            src, dst = self.path(name) / fname, local_dir / fname
            if not (dst.is_file() and dst.stat().st_size == size):
                shutil.copyfile(src, dst)

    def set_aside(self, name: str) -> None:
        """The old folder loses its marker, then is renamed to a trash folder beside it (fast, whatever its size)."""
        folder = self.path(name)
        if not folder.exists():
            return
        self._drop_marker(folder)
        os.replace(folder, folder.with_name(f"{_TRASH}{folder.name}-{os.getpid()}-{time.time_ns()}"))

    def empty_trash(self) -> None:
        for parent in (self.root, self.root / "snapshot"):
            for trash in parent.glob(f"{_TRASH}*"):
                shutil.rmtree(trash, ignore_errors=True)
