"""Where checkpoints live: a local folder or an object store (`s3://bucket/prefix`), behind one small interface.

Layout under a destination (InternLM's: a folder per step, two snapshot slots):

    <save_ckpt_folder>/
      10/                          regular checkpoint of step 10
        .metadata                  DCP's index of every item (read back with a restricted unpickler)
        __0_0.distcp ...           DCP shards, one or more per rank: model, optimizer and all other state
        meta.json                  step, tokens, layout, versions, what resumes exactly, the config text
        config.yaml                the run's resolved config (the same text as in meta.json)
        COMPLETE                   the completion marker, written last (JSON: step, kind, every file and its size)
      20/ ...
      snapshot/0/  snapshot/1/     `oss_snapshot_freq`'s two alternating slots, the same inside

A checkpoint is complete when its marker exists and every file the marker lists is there with its size.

Object storage goes through boto3: the endpoint and credentials come from the environment (AWS_ENDPOINT_URL or
AWS_ENDPOINT_URL_S3, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, or boto3's other sources) and
are never logged.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from ..errors import CheckpointError
from ..utils.logging import get_logger

logger = get_logger(__name__)

MARKER = "COMPLETE"
META = "meta.json"
CONFIG = "config.yaml"
DCP_METADATA = ".metadata"
SNAPSHOT_SLOTS = ("snapshot/0", "snapshot/1")
_STEP_NAME = re.compile(r"^\d+$")

T = TypeVar("T")


def is_checkpoint_name(name: str) -> bool:
    """A regular checkpoint folder (its step number) or one of the two snapshot slots."""
    return bool(_STEP_NAME.match(name)) or name in SNAPSHOT_SLOTS


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


class Destination:
    """Where a run's checkpoints go; `name` is a checkpoint's folder relative to the root ("10", "snapshot/0")."""

    url: str
    remote: bool = False

    def child(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def list_names(self) -> list[str]:
        """Names of the checkpoint folders that exist (complete or not)."""
        raise NotImplementedError

    def read_text(self, name: str, filename: str) -> Optional[str]:
        """A file's text, or None when it does not exist."""
        raise NotImplementedError

    def file_sizes(self, name: str) -> dict[str, int]:
        """{file name: size in bytes} of every file in a checkpoint folder ({} if it does not exist)."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        """Remove a checkpoint: its marker first (so that a half-deleted one counts as incomplete), then the rest."""
        raise NotImplementedError

    def read_marker(self, name: str) -> Optional[dict]:
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


class LocalDestination(Destination):
    """A folder on a (shared, for several nodes) file system; DCP writes straight into it."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.url = str(self.root)

    def path(self, name: str) -> Path:
        return self.root / name

    def child(self, name: str) -> str:
        return str(self.path(name))

    def list_names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        names = [p.name for p in self.root.iterdir() if p.is_dir() and _STEP_NAME.match(p.name)]
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

    def delete(self, name: str) -> None:
        folder = self.path(name)
        try:
            (folder / MARKER).unlink()
            fsync_dir(folder)
        except FileNotFoundError:
            pass
        shutil.rmtree(folder, ignore_errors=True)


class S3Destination(Destination):
    """`s3://bucket/prefix` through boto3; checkpoints are written locally first, then uploaded."""

    remote = True

    def __init__(self, url: str, attempts: int = 3, backoff_s: float = 1.0):
        m = re.match(r"^s3://([^/]+)/?(.*)$", url)
        if not m:
            raise CheckpointError(f"ckpt.save_ckpt_folder: cannot read {url!r}; expected s3://bucket/prefix")
        self.bucket, self.prefix = m.group(1), m.group(2).strip("/")
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self.attempts, self.backoff_s = attempts, backoff_s
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            try:
                import boto3
                from botocore.config import Config as BotoConfig
            except ImportError:
                raise CheckpointError(f"{self.url}: s3:// checkpoints need boto3 (pip install boto3)") from None
            # endpoint (AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3) and credentials: boto3 reads them from the environment
            self._client = boto3.client("s3", config=BotoConfig(retries={"max_attempts": 3, "mode": "standard"},
                                                                connect_timeout=30, read_timeout=120))
        return self._client

    def key(self, name: str, filename: str = "") -> str:
        return "/".join(p for p in (self.prefix, name, filename) if p)

    def _list(self, prefix: str, delimiter: Optional[str] = None) -> tuple[list[dict], list[str]]:
        objects: list[dict] = []
        prefixes: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": prefix}
        if delimiter:
            kwargs["Delimiter"] = delimiter
        while True:
            page = self.client.list_objects_v2(**kwargs)
            objects += page.get("Contents", [])
            prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                return objects, prefixes
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def list_names(self) -> list[str]:
        base = self.key("") + "/" if self.prefix else ""
        _, prefixes = retry(lambda: self._list(base, "/"), f"listing {self.url}", self.attempts, self.backoff_s)
        names = [p[len(base):].rstrip("/") for p in prefixes]
        out = [n for n in names if _STEP_NAME.match(n)]
        if "snapshot" in names:
            _, slots = retry(lambda: self._list(base + "snapshot/", "/"), f"listing {self.url}/snapshot",
                             self.attempts, self.backoff_s)
            out += [s for s in (p[len(base):].rstrip("/") for p in slots) if s in SNAPSHOT_SLOTS]
        return out

    def read_text(self, name: str, filename: str) -> Optional[str]:
        def get() -> Optional[str]:
            from botocore.exceptions import ClientError
            try:
                obj = self.client.get_object(Bucket=self.bucket, Key=self.key(name, filename))
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                    return None
                raise
            return obj["Body"].read().decode("utf-8")
        return retry(get, f"reading {self.child(name)}/{filename}", self.attempts, self.backoff_s)

    def file_sizes(self, name: str) -> dict[str, int]:
        base = self.key(name) + "/"
        objects, _ = retry(lambda: self._list(base), f"listing {self.child(name)}", self.attempts, self.backoff_s)
        return {o["Key"][len(base):]: int(o["Size"]) for o in objects if "/" not in o["Key"][len(base):]}

    def upload_file(self, local: Path, name: str, filename: str) -> None:
        retry(lambda: self.client.upload_file(str(local), self.bucket, self.key(name, filename)),
              f"uploading {filename} to {self.child(name)}", self.attempts, self.backoff_s)

    def put_text(self, name: str, filename: str, text: str) -> None:
        retry(lambda: self.client.put_object(Bucket=self.bucket, Key=self.key(name, filename),
                                             Body=text.encode("utf-8")),
              f"writing {self.child(name)}/{filename}", self.attempts, self.backoff_s)

    def download(self, name: str, files: dict[str, int], local_dir: Path) -> None:
        """Every listed file into `local_dir` (skipping ones already there with their size), atomically each."""
        local_dir.mkdir(parents=True, exist_ok=True)
        for fname, size in sorted(files.items()):
            dst = local_dir / fname
            if dst.is_file() and dst.stat().st_size == size:
                continue
            tmp = local_dir / f"{fname}.part{os.getpid()}"
            retry(lambda: self.client.download_file(self.bucket, self.key(name, fname), str(tmp)),
                  f"downloading {self.child(name)}/{fname}", self.attempts, self.backoff_s)
            if tmp.stat().st_size != size:
                tmp.unlink()
                raise CheckpointError(f"{self.child(name)}/{fname}: downloaded {tmp.stat().st_size} bytes, "
                                      f"the marker says {size}")
            os.replace(tmp, dst)

    def delete(self, name: str) -> None:
        retry(lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key(name, MARKER)),
              f"deleting {self.child(name)}/{MARKER}", self.attempts, self.backoff_s)
        base = self.key(name) + "/"
        objects, _ = retry(lambda: self._list(base), f"listing {self.child(name)}", self.attempts, self.backoff_s)
        keys = [{"Key": o["Key"]} for o in objects]
        for i in range(0, len(keys), 1000):
            batch = keys[i:i + 1000]
            retry(lambda: self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}),
                  f"deleting {self.child(name)}", self.attempts, self.backoff_s)


def parse_destination(url: str | os.PathLike, attempts: int = 3, backoff_s: float = 1.0) -> Destination:
    """A local folder (optionally `local:`-prefixed) or `s3://bucket/prefix` (also InternLM's `boto3:s3://...`)."""
    text = str(url)
    for prefix in ("local:", "boto3:"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    if text.startswith("s3://"):
        return S3Destination(text, attempts, backoff_s)
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text):
        raise CheckpointError(f"checkpoint location {text!r}: unsupported scheme; expected a local folder or "
                              "s3://bucket/prefix")
    return LocalDestination(text)
