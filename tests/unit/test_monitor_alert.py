"""Alert senders against a real HTTP server on loopback."""

import json
import logging
import time
from types import SimpleNamespace

import pytest

from internlm_core.monitor.alert import AlertManager, FeishuSink, FileSink, WebhookSink, build_alert_manager
from tests.helpers.webhook_receiver import WebhookReceiver


@pytest.fixture
def slurm_env(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("JOB_NAME", raising=False)
    monkeypatch.delenv("INTERNLM_FEISHU_ALERT_ADDRESS", raising=False)
    monkeypatch.delenv("INTERNLM_ALERT_WEBHOOK", raising=False)


def test_json_webhook_fields(slurm_env):
    with WebhookReceiver() as rx:
        am = AlertManager([WebhookSink(rx.url)], job_name="llm7b", rank=3)
        assert am.send("loss spike", "step 10: loss 9.0", level="warning")
        assert am.flush(10)
        (body,) = rx.wait_for(1)
        am.close()
    assert set(body) == {"title", "content", "job", "rank", "host", "slurm_job_id", "level", "time"}
    assert body["title"] == "[WARNING] llm7b (slurm 4242): loss spike"
    assert body["content"] == "step 10: loss 9.0"
    assert (body["job"], body["rank"], body["slurm_job_id"], body["level"]) == ("llm7b", 3, "4242", "warning")
    assert body["host"]
    assert am.delivered == 1 and am.failed == 0


def test_feishu_post_and_interactive_format(slurm_env):
    with WebhookReceiver() as rx:
        am = AlertManager([FeishuSink(rx.url), FeishuSink(rx.url, msg_type="interactive")], job_name="llm7b")
        am.send("rank 1 failed", "Traceback line")
        assert am.flush(10)
        post, card = rx.wait_for(2)
        am.close()
    assert post["msg_type"] == "post"
    zh = post["content"]["post"]["zh_cn"]
    assert zh["title"] == "[ERROR] llm7b (slurm 4242): rank 1 failed"
    assert zh["content"][0][0]["tag"] == "text"
    assert zh["content"][0][0]["text"].startswith("Traceback line\n\nrank 0 on ")
    assert card["msg_type"] == "interactive"
    assert card["card"]["header"]["title"]["content"] == "[ERROR] llm7b (slurm 4242): rank 1 failed"
    assert card["card"]["header"]["template"] == "red"


def test_feishu_refusal_counts_as_failure(slurm_env, monkeypatch):
    # Feishu refuses with HTTP 200 and a non-zero "code" in the body
    from internlm_core.monitor import alert as alert_mod

    calls = []

    def fake_post(url, payload, timeout):
        calls.append(payload["msg_type"])
        return b'{"code": 9499, "msg": "too many request"}'

    monkeypatch.setattr(alert_mod, "_post_json", fake_post)
    am = AlertManager([FeishuSink("http://unused")], max_retries=1, backoff=0.01)
    am.send("x", "y")
    assert am.flush(10)
    am.close()
    assert calls == ["post", "post"]
    assert (am.delivered, am.failed) == (0, 1)


def test_file_sink_appends_json_lines(tmp_path, slurm_env):
    path = tmp_path / "alerts" / "alerts.jsonl"
    am = AlertManager([FileSink(path)], job_name="j", rank=1)
    am.send("a", "first")
    am.send("b", "second", level="info")
    assert am.close(10)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["content"] for x in lines] == ["first", "second"]
    assert [x["level"] for x in lines] == ["error", "info"]
    assert lines[0]["rank"] == 1


def test_hanging_server_bounded_by_timeout_and_retries(slurm_env, caplog):
    with WebhookReceiver(delay=30) as rx:
        am = AlertManager([WebhookSink(rx.url)], timeout=0.5, max_retries=2, backoff=0.05)
        with caplog.at_level(logging.WARNING, logger="internlm_core"):
            assert am.send("hang", "content")
            # send only queued it: nothing is settled yet (a send that delivered would have failed three times by now)
            assert (am.delivered, am.failed) == (0, 0)
            drained = am.flush(10)  # drains well before the server's 30 s hang ends: each attempt times out
            settled = (am.delivered, am.failed)
            arrived = len(rx.wait_for(3, timeout=1))
        am.close(1)
    assert drained and settled == (0, 1)
    assert arrived == 3  # the first attempt and two retries, then no more
    # every attempt ended on the client's timeout, in order, and only the last gave up
    attempts = [r.getMessage() for r in caplog.records if "alert to json webhook failed" in r.getMessage()]
    assert attempts == [f"alert to json webhook failed (attempt {i}/3): TimeoutError: timed out" + tail
                        for i, tail in ((1, "; retrying"), (2, "; retrying"), (3, ""))]


def test_server_error_retried_a_bounded_number_of_times(slurm_env, caplog):
    with WebhookReceiver(status=500) as rx:
        am = AlertManager([WebhookSink(rx.url)], timeout=2, max_retries=3, backoff=0.01)
        with caplog.at_level(logging.WARNING, logger="internlm_core"):
            am.send("s", "c")
            assert am.flush(10)
        time.sleep(0.2)  # nothing further may arrive
        n = len(rx.received)
        am.close()
    assert n == 4
    assert (am.delivered, am.failed) == (0, 1)
    assert "attempt 4/4): HTTP 500" in caplog.text


def test_client_error_not_retried(slurm_env):
    with WebhookReceiver(status=404) as rx:
        am = AlertManager([WebhookSink(rx.url)], max_retries=3, backoff=0.01)
        am.send("s", "c")
        assert am.flush(10)
        time.sleep(0.2)
        n = len(rx.received)
        am.close()
    assert n == 1 and am.failed == 1


def test_flush_returns_false_when_not_drained(slurm_env):
    with WebhookReceiver(delay=30) as rx:
        am = AlertManager([WebhookSink(rx.url)], timeout=5, max_retries=0)
        am.send("s", "c")
        assert am.flush(0.3) is False  # False only when its deadline passed with the alert still in flight
        assert (am.delivered, am.failed) == (0, 0)
        am.close(0)
        rx.wait_for(1)


def test_full_queue_drops_instead_of_blocking(slurm_env):
    with WebhookReceiver(delay=30) as rx:
        am = AlertManager([WebhookSink(rx.url)], timeout=5, max_retries=0, queue_size=2)
        results = [am.send("s", "0")]
        rx.wait_for(1)  # the first is in flight, off the queue
        results += [am.send("s", str(i)) for i in range(1, 6)]
        am.close(0)
    # one in flight plus two queued; the other three dropped at once
    assert results == [True, True, True, False, False, False] and am.dropped == 3


def test_build_from_config_and_env_never_logs_the_address(monkeypatch, caplog, slurm_env):
    with WebhookReceiver() as rx:
        secret_url = rx.url + "?token=s3cr3t-t0ken"
        monkeypatch.setenv("INTERNLM_FEISHU_ALERT_ADDRESS", secret_url)
        monkeypatch.setenv("INTERNLM_ALERT_WEBHOOK", secret_url)
        cfg = SimpleNamespace(alert=SimpleNamespace(enable_feishu_alert=True, feishu_alert_address=None,
                                                    webhook_url=None, alert_file_path=None))
        with caplog.at_level(logging.DEBUG, logger="internlm_core"):
            am = build_alert_manager(cfg, job_name="envjob", rank=0)
            assert [type(s).__name__ for s in am.sinks] == ["FeishuSink", "WebhookSink"]
            am.send("t", "c")
            assert am.flush(10)
            bodies = rx.wait_for(2)
            am.close()
    assert {b.get("msg_type", "json") for b in bodies} == {"post", "json"}
    assert "feishu webhook configured: yes, json webhook configured: yes" in caplog.text
    assert "s3cr3t" not in caplog.text and "127.0.0.1" not in caplog.text


def test_failure_log_redacts_address(monkeypatch, caplog, slurm_env):
    url = "http://127.0.0.1:9/hook?token=s3cr3t"  # port 9 (discard): connection refused
    am = AlertManager([WebhookSink(url)], timeout=1, max_retries=0)
    with caplog.at_level(logging.WARNING, logger="internlm_core"):
        am.send("t", "c")
        assert am.flush(10)
    am.close()
    assert "alert to json webhook failed" in caplog.text
    assert "s3cr3t" not in caplog.text


def test_disabled_feishu_and_no_destinations(slurm_env):
    cfg = SimpleNamespace(alert=SimpleNamespace(enable_feishu_alert=False, feishu_alert_address="http://x",
                                                webhook_url=None, alert_file_path=None))
    am = build_alert_manager(cfg, "j", 0)
    assert not am.enabled
    assert am.send("t", "c") is False
    assert am.flush(0.1) is True
