"""train.py saving to s3:// (an S3-compatible moto server on loopback, reached through boto3 with the endpoint and
keys in the environment), killed with SIGKILL after step 10's checkpoint is uploaded, then auto-resumed from the
object store: the losses of steps 11..20 equal an uninterrupted run's, and the secret key appears in no output."""

from __future__ import annotations

import json
import signal

import pytest

from tests.helpers.ckpt_faults import ENV as FAULT_ENV
FAULT_SCRIPT = "tests/helpers/ckpt_faults.py"  # train.py with the faults of FAULT_ENV injected
from tests.helpers.launch import read_metrics, run_train

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

pytestmark = pytest.mark.slow

BUCKET = "train-ckpts"
SECRET = "e2e-s3cr3t-must-not-leak-42"
STEPS = 20


@pytest.fixture
def s3_env():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "e2e-key-id",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=SECRET, region_name="us-east-1")
    client.create_bucket(Bucket=BUCKET)
    yield env, client
    server.stop()


def train_args(run, folder, stage, *extra):
    return ["--config", "configs/tiny.py", "--run-dir", str(run), "--set", f"data.total_steps={STEPS}",
            "data.seq_len=64", "data.valid_every=0", "monitor.tensorboard=False", "monitor.log_every=5", "ckpt.enable_save_ckpt=True",
            f"ckpt.save_ckpt_folder={folder}", f"ckpt.async_upload_tmp_folder={stage}", "ckpt.checkpoint_every=10",
            *extra]


def test_upload_to_s3_kill_and_auto_resume_from_it(tmp_path, s3_env):
    env, client = s3_env
    folder = f"s3://{BUCKET}/runs/tiny"
    ref = run_train(train_args(tmp_path / "ref", tmp_path / "ref_ckpt", tmp_path / "ref_stage"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_loss = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "ref")}

    p = run_train(train_args(tmp_path / "killed", folder, tmp_path / "stage"),
                  extra_env={**env, FAULT_ENV: "kill_after_commit@10"}, script=FAULT_SCRIPT)
    assert p.returncode == -signal.SIGKILL, p.stdout[-3000:] + p.stderr[-3000:]
    marker = json.loads(client.get_object(Bucket=BUCKET, Key="runs/tiny/10/COMPLETE")["Body"].read())
    listed = {o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="runs/tiny/")["Contents"]}
    assert marker["step"] == 10 and {f"runs/tiny/10/{k}": v for k, v in marker["files"].items()} == \
        {k: v for k, v in listed.items() if k.startswith("runs/tiny/10/") and not k.endswith("/COMPLETE")}
    assert sorted(marker["checksums"]) == sorted(marker["files"])  # crc32 of every uploaded file
    assert "runs/tiny/LEASE" in listed  # the killed run's lease, taken over by the next run (its holder is gone)

    q = run_train(train_args(tmp_path / "resumed", folder, tmp_path / "stage"), extra_env=env)
    assert q.returncode == 0, q.stdout[-3000:] + q.stderr[-3000:]
    assert f"loaded {folder}/10 (step 10, regular" in q.stdout
    resumed = read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == list(range(11, STEPS + 1))
    assert [r["loss"] for r in resumed] == [ref_loss[s] for s in range(11, STEPS + 1)]
    assert client.head_object(Bucket=BUCKET, Key="runs/tiny/20/COMPLETE")["ContentLength"] > 0
    assert "runs/tiny/LEASE" not in {o["Key"] for o in client.list_objects_v2(Bucket=BUCKET, Prefix="runs/")["Contents"]}
    assert not list((tmp_path / "stage/upload").glob("*"))  # local copies removed after their uploads

    logs = [p.stdout, p.stderr, q.stdout, q.stderr] + [f.read_text() for f in tmp_path.glob("*/rank*.log")]
    assert all(SECRET not in text for text in logs)
