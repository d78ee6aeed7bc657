"""`s3://bucket/prefix` checkpoints through boto3: written locally first, then uploaded; downloaded to be read.

The endpoint and credentials come from the environment (AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_S3,
AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, or boto3's other sources) and are never logged.
Every request is retried with exponential backoff (`attempts`, `backoff_s`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from ..errors import CheckpointError
from .storage import STEP_NAME, MARKER, SNAPSHOT_SLOTS, Storage, retry


# InternLM's `boto3:s3://bucket.ENDPOINT/prefix`: the endpoint (an IP address, plain http on port 80) is part of
# the bucket string (InternLM's storage_manager.get_boto3_meta)
_INTERNLM_BUCKET = re.compile(r"^([^.]+)\.(\d+(?:\.\d+){3})$")
# InternLM's names of the credentials (its Boto3Client reads these, not AWS_*)
INTERNLM_KEY_VARS = ("S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY_ID")


def split_internlm_bucket(url: str) -> tuple[str, Optional[str]]:
    """`boto3:s3://bucket.10.1.2.3/prefix` → (`s3://bucket/prefix`, `http://10.1.2.3:80`); other URLs unchanged
    (without an endpoint: boto3's, from AWS_ENDPOINT_URL or its default)."""
    if not url.startswith("boto3:"):
        return url, None
    url = url[len("boto3:"):]
    m = re.match(r"^s3://([^/]+)(/.*)?$", url)
    if m:
        b = _INTERNLM_BUCKET.match(m.group(1))
        if b:
            return f"s3://{b.group(1)}{m.group(2) or ''}", f"http://{b.group(2)}:80"
    return url, None


class S3Storage(Storage):
    """`s3://bucket/prefix` through boto3; checkpoints are written locally first, then uploaded. InternLM's
    `boto3:s3://bucket.ENDPOINT/prefix` names the endpoint in the bucket string (kept in `url`, so that children
    of this storage name it too)."""

    def __init__(self, url: str, attempts: int = 3, backoff_s: float = 1.0):
        original = url
        url, self.endpoint = split_internlm_bucket(url)
        m = re.match(r"^s3://([^/]+)/?(.*)$", url)
        if not m:
            raise CheckpointError(f"ckpt.save_ckpt_folder: cannot read {url!r}; expected s3://bucket/prefix")
        self.bucket, self.prefix = m.group(1), m.group(2).strip("/")
        self.url = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        if self.endpoint is not None:
            self.url = original.rstrip("/")
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
            # endpoint (the URL's, else AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3) and credentials (InternLM's
            # S3_ACCESS_KEY_ID / S3_SECRET_ACCESS_KEY_ID when set, else boto3's own sources)
            kwargs: dict[str, Any] = {}
            if self.endpoint is not None:
                kwargs["endpoint_url"] = self.endpoint
            key_id, secret = (os.environ.get(v) for v in INTERNLM_KEY_VARS)
            if key_id and secret:
                kwargs.update(aws_access_key_id=key_id, aws_secret_access_key=secret)
            self._client = boto3.client("s3", config=BotoConfig(retries={"max_attempts": 3, "mode": "standard"},
                                                                connect_timeout=30, read_timeout=120), **kwargs)
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
        out = [n for n in names if STEP_NAME.match(n)]
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

    def remove_file(self, name: str, filename: str) -> None:
        retry(lambda: self.client.delete_object(Bucket=self.bucket, Key=self.key(name, filename)),
              f"deleting {self.child(name)}/{filename}", self.attempts, self.backoff_s)

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
