"""Secrets never reach a file or a log line (utils/redact.py), and a resumed run still has them: a run with two alert
webhooks, credentials inside a URL and a secret in the environment, then a resume from the config.yaml it wrote
with the webhooks given by the environment."""

from pathlib import Path

import pytest

from tests.helpers.launch import read_metrics, run_train
from tests.helpers.webhook_receiver import WebhookReceiver

pytestmark = pytest.mark.slow

WEBHOOK_TOKEN = "wh-T0KEN-5f3a9c"
FEISHU_TOKEN = "fs-T0KEN-77b2e1"
S3_KEY, S3_SECRET = "AKIAEXAMPLE42", "wJalrXUtnFEMI/K7MDENG"
ENV_SECRET = "wandb-env-key-0c8d1f"
SECRETS = (WEBHOOK_TOKEN, FEISHU_TOKEN, S3_KEY, S3_SECRET, ENV_SECRET)


def leaks(folders: list[Path], texts: list[str]) -> list[str]:
    """'file: secret' for every secret found in any file under `folders` (binary ones too) or in `texts`."""
    found = [f"output: {s}" for t in texts for s in SECRETS if s in t]
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file():
                data = path.read_bytes()
                found += [f"{path}: {s}" for s in SECRETS if s.encode() in data]
    return found


def test_secrets_are_redacted_everywhere_and_a_resumed_run_still_alerts(tmp_path):
    run1, run2, ckpt = tmp_path / "run1", tmp_path / "run2", tmp_path / "ckpt"
    with WebhookReceiver() as rx:
        webhook, feishu = f"{rx.url}/{WEBHOOK_TOKEN}", f"{rx.url}/{FEISHU_TOKEN}"
        common = ["data.valid_every=0", "monitor.tensorboard=False", "ckpt.enable_save_ckpt=True",
                  f"ckpt.save_ckpt_folder={ckpt}", "ckpt.checkpoint_every=2"]
        p1 = run_train(["--config", "configs/tiny.py", "--run-dir", str(run1), "--set", *common, "data.total_steps=2",
                        f"monitor.alert.webhook_url={webhook}", "monitor.alert.enable_feishu_alert=True",
                        f"monitor.alert.feishu_alert_address={feishu}",
                        f"tokenizer=s3://{S3_KEY}:{S3_SECRET}@10.0.0.1:9000/tok/tokenizer.model"],
                       extra_env={"WANDB_API_KEY": ENV_SECRET})
        assert p1.returncode == 0, p1.stdout[-3000:] + p1.stderr[-3000:]
        first = rx.wait_for(4)  # started and finished, on both webhooks
        assert len(first) == 4, first
        # the resume: the config the run wrote (secrets redacted), the webhooks from the environment
        p2 = run_train(["--config", str(run1 / "config.yaml"), "--run-dir", str(run2), "--set", "data.total_steps=4"],
                       extra_env={"WANDB_API_KEY": ENV_SECRET, "INTERNLM_ALERT_WEBHOOK": webhook,
                                  "INTERNLM_FEISHU_ALERT_ADDRESS": feishu})
        assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
        bodies = rx.wait_for(8)
    assert len(bodies) == 8, bodies
    assert [r["step"] for r in read_metrics(run2)] == [3, 4]  # resumed from step 2
    assert sum("training started" in str(b) for b in bodies[4:]) == 2  # the resumed run alerted on both
    assert leaks([run1, run2, ckpt], [p1.stdout, p1.stderr, p2.stdout, p2.stderr, str(bodies)]) == []
    config_text = (run1 / "config.yaml").read_text()
    assert "webhook_url: <redacted>" in config_text and "feishu_alert_address: <redacted>" in config_text
    assert "tokenizer: s3://<redacted>@10.0.0.1:9000/tok/tokenizer.model" in config_text
    assert "monitor.alert.webhook_url=<redacted>" in (run1 / "launch.json").read_text()
    assert "webhook_url: <redacted>" in (ckpt / "2" / "meta.json").read_text()
    assert (ckpt / "2" / "config.yaml").read_text() == config_text


def test_every_tracker_gets_only_redacted_values(tmp_path):
    """wandb and mlflow with secrets given every way (--set, the config file, the environment): none reaches any
    file under the run, checkpoint and tracker folders, whatever a tracker captures by itself (wandb: the command
    line, the machine, git; mlflow: parameters and tags)."""
    set_token, file_token = "set-T0KEN-91ab2c", "file-T0KEN-4d7e0f"
    run, ckpt, store, wandb_dir = (tmp_path / d for d in ("run", "ckpt", "mlruns", "wandb"))
    wandb_dir.mkdir()
    config = tmp_path / "secret_config.py"
    config.write_text(Path("configs/tiny.py").read_text() + (
        "monitor = dict(log_every=1, tensorboard=False, trackers=['wandb', 'mlflow'], alert=dict(\n"
        f"    enable_feishu_alert=True, feishu_alert_address='http://127.0.0.1:9/fs?token={file_token}'))\n"))
    p = run_train(["--config", str(config), "--run-dir", str(run), "--set", "data.total_steps=2", "data.seq_len=64",
                   "data.valid_every=0", "ckpt.enable_save_ckpt=True", f"ckpt.save_ckpt_folder={ckpt}",
                   f"monitor.alert.webhook_url=http://127.0.0.1:9/hook?token={set_token}"],
                  extra_env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_API_KEY": ENV_SECRET,
                             "MLFLOW_TRACKING_URI": f"file:{store}", "MLFLOW_ALLOW_FILE_STORE": "true"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "tracker wandb: started run" in p.stdout + p.stderr and "tracker mlflow: started run" in p.stdout + p.stderr
    assert len(list(wandb_dir.rglob("run-*.wandb"))) == 1 and any(store.rglob("meta.yaml"))
    found = [f"{path}: {s}" for folder in (run, ckpt, store, wandb_dir) for path in folder.rglob("*")
             if path.is_file() for s in (set_token, file_token, ENV_SECRET) if s.encode() in path.read_bytes()]
    assert found == []
    assert [s for s in (set_token, file_token, ENV_SECRET) if s in p.stdout + p.stderr] == []
