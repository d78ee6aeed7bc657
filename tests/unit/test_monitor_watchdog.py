"""Hang watchdog: a stalled step fires an alert and dumps every thread's stack to the log."""

import logging
import threading
import time

import pytest

from internlm_core.monitor.alert import AlertManager, WebhookSink
from tests.helpers.webhook_receiver import WebhookReceiver
from internlm_core.monitor.watchdog import HangWatchdog, build_watchdog


def stalled_step_in_a_collective(release: threading.Event) -> None:
    release.wait(10)


def test_stall_fires_alert_and_logs_stacks(caplog):
    release = threading.Event()
    worker = threading.Thread(target=stalled_step_in_a_collective, args=(release,), name="fake-step")
    with WebhookReceiver() as rx, caplog.at_level(logging.WARNING, logger="internlm_core"):
        am = AlertManager([WebhookSink(rx.url)], job_name="hangjob", rank=0)
        wd = HangWatchdog(0.3, alerts=am, rank=0)
        wd.start()
        wd.beat(step=7)
        worker.start()
        (body,) = rx.wait_for(1, timeout=10)
        release.set()
        worker.join()
        wd.stop()
        am.close()
    assert wd.fired >= 1
    assert body["title"] == "[ERROR] hangjob: training may be hung"
    assert "no training step completed for 0 s after step 7 (hang_timeout 0.3 s)" in body["content"]
    assert "Main thread:" in body["content"]
    assert "Python stacks of all threads on rank 0" in caplog.text
    assert "Thread fake-step" in caplog.text
    assert "in stalled_step_in_a_collective" in caplog.text
    assert "release.wait(10)" in caplog.text


def test_beats_keep_it_quiet_and_it_refires_once_per_period(caplog):
    wd = HangWatchdog(0.5)
    with caplog.at_level(logging.WARNING, logger="internlm_core"):
        wd.start()
        for step in range(12):  # 0.6 s of regular steps, each well within the timeout
            time.sleep(0.05)
            wd.beat(step)
        assert wd.fired == 0
        time.sleep(1.25)  # stall: fires at ~0.5 s and ~1.0 s after the last beat, not more often
        fired_during_stall = wd.fired
        wd.beat(99)
        wd.stop()
    assert fired_during_stall == 2
    assert "progress again at step 99 after" in caplog.text


def test_stop_is_prompt_and_callback_wiring():
    wd = HangWatchdog(60)
    wd.on_train_start(None)  # the StepView it observes (unused by the watchdog)
    wd.on_step_end(None, {"step": 3})
    assert wd.last_step == 3
    t0 = time.monotonic()
    wd.on_train_end(None)
    assert time.monotonic() - t0 < 1.0
    assert wd._thread is None


def test_build_from_config():
    from internlm_core.config.schema import MonitorConfig

    assert build_watchdog(MonitorConfig(hang_timeout=0.0)) is None
    wd = build_watchdog(MonitorConfig(hang_timeout=120), rank=2)
    assert wd.timeout == 120 and wd.rank == 2
    with pytest.raises(ValueError, match="expected > 0 seconds"):
        HangWatchdog(0)


def test_hang_action_exit_ends_the_process_with_its_status(tmp_path):
    """hang_action "exit": a stalled process alerts (the alert is flushed first) and exits with HANG_EXIT_CODE."""
    import subprocess
    import sys

    from internlm_core.monitor.watchdog import HANG_EXIT_CODE
    from tests.helpers.launch import ROOT, env

    alerts = tmp_path / "alerts.jsonl"
    code = ("import time\n"
            "from internlm_core.monitor.alert import AlertManager, FileSink\n"
            "from internlm_core.monitor.watchdog import HangWatchdog\n"
            f"am = AlertManager([FileSink({str(alerts)!r})], job_name='hang')\n"
            "wd = HangWatchdog(0.3, alerts=am, action='exit')\n"
            "wd.start(); wd.beat(4)\n"
            "time.sleep(30)\n"
            "print('not reached')\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=60)
    assert p.returncode == HANG_EXIT_CODE == 3, p.stderr[-2000:]
    assert time.monotonic() - t0 < 20 and "not reached" not in p.stdout
    assert "hang watchdog: ending rank 0 after 0 s without a step (monitor.hang_action=exit); exit status 3" in p.stderr
    import json
    (alert,) = [json.loads(line) for line in alerts.read_text().splitlines()]
    assert alert["title"] == "[ERROR] hang: training may be hung"
    assert "Ending the process (exit status 3) so that the launcher restarts the job." in alert["content"]


def test_hang_action_is_checked():
    with pytest.raises(ValueError, match=r"monitor.hang_action: expected one of alert, exit, got 'restart'"):
        HangWatchdog(5, action="restart")

    class Cfg:
        hang_timeout = 30
        hang_action = "exit"

    assert build_watchdog(Cfg()).action == "exit"
