"""The redaction rule (internlm_core/utils/redact.py): which keys and values are secrets, the command line, the
log filter, and a config written by a run read back without its secrets."""

import logging

import pytest
import yaml

from internlm_core.config import dump_yaml, load_config
from internlm_core.utils import redact
from internlm_core.utils.logging import get_logger, setup_logging
from internlm_core.utils.redact import REDACTED, is_secret_key, redact_argv, redact_text, redact_tree


@pytest.mark.parametrize("key", ["webhook_url", "monitor.alert.feishu_alert_address", "wandb_api_key", "token",
                                 "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "S3_SECRET_ACCESS_KEY_ID", "db_password",
                                 "client-secret", "--api-key", "credentials", "INTERNLM_ALERT_WEBHOOK"])
def test_secret_keys(key):
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["tokenizer", "tokenizer_path", "key_value", "max_tokens", "load_ckpt_info",
                                 "monkey", "PWD", "memory_limit_gib", "light_monitor_address", "keys_per_query"])
def test_harmless_keys(key):
    assert not is_secret_key(key)


def test_values_are_redacted_by_form_whatever_the_key():
    text = ("save to s3://AKIAXX:wJal/rXUtn@10.1.2.3:9000/bucket/run, post to "
            "https://open.feishu.cn/open-apis/bot/v2/hook/0a1b2c3d and "
            "https://example.com/x?a=1&access_token=t0k3n&b=2")
    out = redact_text(text)
    for secret in ("AKIAXX", "wJal/rXUtn", "0a1b2c3d", "t0k3n"):
        assert secret not in out
    assert out == (f"save to s3://{REDACTED}@10.1.2.3:9000/bucket/run, post to {REDACTED} and "
                   f"https://example.com/x?a=1&access_token={REDACTED}&b=2")
    assert redact_text("https://example.com:8080/path/file.bin") == "https://example.com:8080/path/file.bin"


def test_tree_redacts_secret_keys_and_keeps_the_rest():
    tree = {"monitor": {"alert": {"webhook_url": "http://127.0.0.1:9/hook/abcdef", "feishu_alert_address": None,
                                  "enable_feishu_alert": True}},
            "trackers": {"wandb_api_key": "wk-123456", "auth": {"user": "me", "extra": ["x1y2z3"]}},
            "ckpt": {"save_ckpt_folder": "s3://id:secret99@host/b", "load_ckpt_info": {"path": "/a/b"}},
            "data": {"seq_len": 16, "tokenizer_path": "byte"}}
    out = redact_tree(tree)
    assert out["monitor"]["alert"] == {"webhook_url": REDACTED, "feishu_alert_address": None,
                                       "enable_feishu_alert": True}
    assert out["trackers"] == {"wandb_api_key": REDACTED, "auth": {"user": REDACTED, "extra": [REDACTED]}}
    assert out["ckpt"] == {"save_ckpt_folder": f"s3://{REDACTED}@host/b", "load_ckpt_info": {"path": "/a/b"}}
    assert out["data"] == tree["data"] and tree["trackers"]["wandb_api_key"] == "wk-123456"  # a copy


def test_argv_redaction():
    argv = ["train.py", "--config", "c.py", "--set", "monitor.alert.webhook_url=http://h/hook/zz99", "data.seq_len=8",
            "ckpt.save_ckpt_folder=s3://k:pw1234@h/b", "--api-key", "sk-9999", "--token=abcdef"]
    assert redact_argv(argv) == ["train.py", "--config", "c.py", "--set", f"monitor.alert.webhook_url={REDACTED}",
                                 "data.seq_len=8", f"ckpt.save_ckpt_folder=s3://{REDACTED}@h/b", "--api-key",
                                 REDACTED, f"--token={REDACTED}"]


def test_log_lines_never_carry_a_registered_secret(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(redact, "_known", set())
    monkeypatch.setattr(redact, "_known_sorted", [])
    monkeypatch.setenv("WANDB_API_KEY", "wandb-env-secret-42")
    setup_logging(0, tmp_path)
    try:
        cfg = load_config("configs/tiny.py", ["monitor.alert.webhook_url=http://127.0.0.1:1/hook/SeCrEt77"])
        log = get_logger("internlm_core.test_redact")
        log.info("posting to %s", cfg.monitor.alert.webhook_url)
        log.warning(f"key {'wandb-env-secret-42'} and s3://user:pass9876@h/b")
        try:
            raise ValueError(f"bad url {cfg.monitor.alert.webhook_url}")
        except ValueError:
            log.exception("failed")
    finally:
        for h in list(logging.getLogger("internlm_core").handlers):
            logging.getLogger("internlm_core").removeHandler(h)
            h.close()
    text = (tmp_path / "rank0.log").read_text() + capsys.readouterr().out
    assert text.count(f"posting to {REDACTED}") == 2  # file and console
    for secret in ("SeCrEt77", "wandb-env-secret-42", "pass9876"):
        assert secret not in text
    assert f"bad url {REDACTED}" in text  # the traceback too


def test_a_written_config_reads_back_with_its_secret_unset(tmp_path, monkeypatch):
    """config.yaml of a run says <redacted>; loading it gives None (not the placeholder as a URL), so that the
    alert manager falls back to the environment (INTERNLM_ALERT_WEBHOOK)."""
    cfg = load_config("configs/tiny.py", ["monitor.alert.webhook_url=http://127.0.0.1:1/hook/abc123",
                                          "monitor.alert.enable_feishu_alert=True",
                                          "monitor.alert.feishu_alert_address=https://open.feishu.cn/x/y"])
    text = dump_yaml(cfg)
    assert "abc123" not in text and "open.feishu.cn" not in text
    assert yaml.safe_load(text)["monitor"]["alert"]["webhook_url"] == REDACTED
    (tmp_path / "config.yaml").write_text(text)
    again = load_config(tmp_path / "config.yaml")
    assert again.monitor.alert.webhook_url is None and again.monitor.alert.feishu_alert_address is None
    assert cfg.monitor.alert.webhook_url == "http://127.0.0.1:1/hook/abc123"  # the live config keeps it
    from internlm_core.monitor.alert import WEBHOOK_ENV, build_alert_manager
    monkeypatch.setenv(WEBHOOK_ENV, "http://127.0.0.1:1/hook/from-env")
    monkeypatch.delenv("INTERNLM_FEISHU_ALERT_ADDRESS", raising=False)
    manager = build_alert_manager(again.monitor, "job")
    try:
        assert [type(s).__name__ for s in manager.sinks] == ["WebhookSink"]
        assert manager.sinks[0].url == "http://127.0.0.1:1/hook/from-env"
    finally:
        manager.close(timeout=1)


def test_lease_crash_report_and_alerts_carry_no_secret(tmp_path, monkeypatch):
    """The checkpoint folder's LEASE records the command line; a failure writes a crash report (traceback and log
    tail) and sends an alert (here to a file): none of them may quote the webhook of `--set`."""
    from internlm_core.checkpoint.lease import Holder
    from internlm_core.errors import ConfigError
    from internlm_core.monitor.alert import AlertManager, FileSink
    from internlm_core.monitor.exception_monitor import ExceptionMonitor

    secret = "http://127.0.0.1:1/hook/leaSE-T0KEN"
    monkeypatch.setattr("sys.argv", ["train.py", "--set", f"monitor.alert.webhook_url={secret}"])
    assert Holder.me(str(tmp_path)).argv == f"train.py --set monitor.alert.webhook_url={REDACTED}"
    redact.register_secret(secret)
    alerts = AlertManager([FileSink(tmp_path / "alerts.jsonl")], job_name="job")
    with pytest.raises(ConfigError):
        with ExceptionMonitor(alerts, rank=0, run_dir=tmp_path, job_name="job", hard_exit=False):
            raise ConfigError(f"monitor.alert.webhook_url: {secret} did not answer")
    alerts.close(timeout=5)
    report = (tmp_path / "crash_rank0.txt").read_text()
    sent = (tmp_path / "alerts.jsonl").read_text()
    assert f"monitor.alert.webhook_url: {REDACTED} did not answer" in report and "leaSE-T0KEN" not in report
    assert f"monitor.alert.webhook_url: {REDACTED} did not answer" in sent and "leaSE-T0KEN" not in sent
