"""s3:// checkpoints against an S3-compatible server (moto) on loopback, through boto3: upload with the marker, resume
from a download, incomplete remote checkpoints ignored, failed uploads retried, reported and harmless."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import pytest
import torch

from internlm_core.checkpoint import MARKER, S3Storage, latest_checkpoint
from internlm_core.errors import CheckpointError
from tests.unit.test_checkpoint import build, params

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

BUCKET = "ckpt-bucket"
SECRET = "s3cr3t-never-logged-0123456789"


@pytest.fixture
def s3(monkeypatch):
    """A moto S3 server on 127.0.0.1 (a free port), an empty bucket, and the AWS_* environment pointing at it."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    box = {"server": server, "port": port, "client": client}
    before = set(_lease_threads())  # other tests' trainers in this process may hold theirs
    yield box
    # every trainer of this test gave its folder's lease back: no heartbeat retries against a server that is gone
    assert not set(_lease_threads()) - before
    box["server"].stop()


def _lease_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "internlm_core-lease" and t.is_alive()]


def objects(client, prefix: str) -> dict[str, int]:
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        out.update({o["Key"][len(prefix):]: o["Size"] for o in page.get("Contents", [])})
    return out


def s3_build(tmp_path: Path, run: str, steps: int, *sets: str):
    t = build(tmp_path, run, steps, f"ckpt.async_upload_tmp_folder={tmp_path / 'stage'}", *sets,
              ckpt=f"s3://{BUCKET}/runs/tiny")
    t.checkpoint_manager.dest.backoff_s = 0.05  # retries without the production backoff
    return t


def test_upload_then_resume_from_s3(tmp_path, s3, caplog):
    caplog.set_level(logging.DEBUG)
    a = s3_build(tmp_path, "a", 2)
    a.train()
    stored = objects(s3["client"], "runs/tiny/2/")
    marker = json.loads(s3["client"].get_object(Bucket=BUCKET, Key="runs/tiny/2/COMPLETE")["Body"].read())
    assert marker["step"] == 2
    assert {k: v for k, v in stored.items() if k != MARKER} == marker["files"]
    assert {".metadata", "__0_0.distcp", "meta.json", "config.yaml"} <= set(marker["files"])
    assert not (tmp_path / "stage/upload/2").exists()  # the local copy goes once the upload is complete

    b = s3_build(tmp_path, "b", 2)
    assert b.checkpoint_manager.loaded.url == f"s3://{BUCKET}/runs/tiny/2" and b.state.batch_count == 2
    for name, t in params(a).items():
        assert torch.equal(params(b)[name], t), name
    assert not list((tmp_path / "stage/download").glob("*"))  # the download cache is removed after loading
    assert SECRET not in caplog.text
    b.checkpoint_manager.close()  # gives the lease back: no heartbeat thread outlives the test


def test_incomplete_remote_checkpoint_is_ignored(tmp_path, s3):
    a = s3_build(tmp_path, "a", 4, "ckpt.checkpoint_every=2")
    a.train()
    dest = S3Storage(f"s3://{BUCKET}/runs/tiny")
    assert latest_checkpoint(dest).name == "4"
    s3["client"].delete_object(Bucket=BUCKET, Key="runs/tiny/4/COMPLETE")
    assert latest_checkpoint(dest).name == "2"
    b = s3_build(tmp_path, "b", 4, "ckpt.checkpoint_every=2")
    assert b.checkpoint_manager.loaded.step == 2
    b.checkpoint_manager.close()


def test_failed_upload_is_retried_reported_and_keeps_the_last_good_one(tmp_path, s3, caplog):
    s3_build(tmp_path, "a", 2).train()  # checkpoint 2, complete
    b = s3_build(tmp_path, "b", 4, "ckpt.checkpoint_every=2", "ckpt.keep_last_k=1")
    assert b.checkpoint_manager.loaded.step == 2
    s3["server"].stop()  # the object store goes away
    try:
        with pytest.raises(CheckpointError) as e:
            b.train()  # saves 4: the upload fails
        assert str(e.value).startswith(
            f"the last checkpoint (step 4, s3://{BUCKET}/runs/tiny/4) did not complete: rank 0: clearing "
            f"s3://{BUCKET}/runs/tiny/4: deleting s3://{BUCKET}/runs/tiny/4/COMPLETE: failed after 3 attempt(s): "
            "EndpointConnectionError: ")
        assert str(e.value).endswith("; no checkpoint of this run completed")
        assert "failed (attempt 1 of 3)" in caplog.text and "failed (attempt 2 of 3)" in caplog.text
        assert "CHECKPOINT FAILED: step 4" in caplog.text
        assert f"the local copy stays in {tmp_path / 'stage/upload/4'}" in caplog.text
        assert (tmp_path / "stage/upload/4/__0_0.distcp").is_file()
    finally:
        s3["server"] = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=s3["port"], verbose=False)
        s3["server"].start()
    # checkpoint 2 survived (keep_last_k only runs after a complete save) and is what resumes
    assert latest_checkpoint(S3Storage(f"s3://{BUCKET}/runs/tiny")).step == 2
    assert MARKER not in objects(s3["client"], "runs/tiny/4/")
    c = s3_build(tmp_path, "c", 4)
    assert c.checkpoint_manager.loaded.step == 2
    assert SECRET not in caplog.text
    c.checkpoint_manager.close()
