"""Exception monitor in one process: crash report, alert with the traceback, notices, exit status."""

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from internlm_core.errors import ConfigError
from internlm_core.monitor.alert import AlertManager, WebhookSink
from internlm_core.monitor.exception_monitor import ExceptionMonitor, monitored
from tests.helpers.webhook_receiver import WebhookReceiver
from internlm_core.utils.logging import setup_logging

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def restore_logging():
    """setup_logging reconfigures the package logger; put it back so other tests' caplog still sees records."""
    root = logging.getLogger("internlm_core")
    saved = (list(root.handlers), root.propagate, root.level)
    yield
    for h in list(root.handlers):
        if h not in saved[0]:
            root.removeHandler(h)
            h.close()
    root.handlers[:] = saved[0]
    root.propagate, root.level = saved[1], saved[2]


def inner_failure():
    raise RuntimeError("boom in the step")


def test_crash_report_alert_and_reraise(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    setup_logging(rank=2, run_dir=tmp_path)
    with WebhookReceiver() as rx:
        am = AlertManager([WebhookSink(rx.url)], job_name="crashjob", rank=2)
        mon = ExceptionMonitor(am, rank=2, run_dir=tmp_path, job_name="crashjob", hard_exit=False)
        logging.getLogger("internlm_core.trainer").info("step 5 loss 2.0")
        with pytest.raises(RuntimeError, match="boom in the step"):
            with mon:
                inner_failure()
        bodies = rx.wait_for(1)
        am.close()
    (body,) = bodies  # rank 2 sends no start notice
    assert body["title"] == "[ERROR] crashjob (slurm 77): rank 2 failed: RuntimeError"
    assert body["rank"] == 2 and body["job"] == "crashjob" and body["host"]
    assert f"Exception on rank 2 on {body['host']}:" in body["content"]
    assert "in inner_failure" in body["content"]
    assert 'raise RuntimeError("boom in the step")' in body["content"]
    assert body["content"].splitlines()[-2] == "RuntimeError: boom in the step"
    assert body["content"].endswith(f"crash report: {tmp_path / 'crash_rank2.txt'}")
    report = (tmp_path / "crash_rank2.txt").read_text()
    assert "rank: 2\n" in report and f"host: {body['host']}\n" in report and "job: crashjob (slurm 77)\n" in report
    assert "RuntimeError: boom in the step" in report
    assert "step 5 loss 2.0" in report  # the tail of rank2.log
    assert "Traceback (most recent call last)" in (tmp_path / "rank2.log").read_text()


def test_user_error_gets_one_line(tmp_path, capsys):
    setup_logging(rank=0, run_dir=tmp_path)
    with WebhookReceiver() as rx:
        am = AlertManager([WebhookSink(rx.url)], job_name="cfgjob")
        with pytest.raises(ConfigError):
            with ExceptionMonitor(am, rank=0, run_dir=tmp_path, job_name="cfgjob", hard_exit=False):
                raise ConfigError("data.seq_len: expected int, got 'abc'")
        start, failure = rx.wait_for(2)
        am.close()
    out = capsys.readouterr().out
    assert "ConfigError: data.seq_len: expected int, got 'abc' (rank 0 on" in out
    assert "Traceback" not in out
    assert start["title"] == "[INFO] cfgjob: training started" and start["level"] == "info"
    assert failure["content"].startswith(f"rank 0 on {failure['host']}: ConfigError: data.seq_len: expected int")
    assert "Traceback" not in failure["content"]


def test_finish_notice_and_decorator():
    with WebhookReceiver() as rx:
        am = AlertManager([WebhookSink(rx.url)], job_name="okjob")

        @monitored(am, rank=0, job_name="okjob", world_size=4, hard_exit=False)
        def run(x):
            return x * 2

        assert run(21) == 42
        start, finish = rx.wait_for(2)
        am.close()
    assert "started on" in start["content"] and "with 4 process(es)" in start["content"]
    assert finish["title"] == "[INFO] okjob: training finished"
    assert finish["content"].startswith("job okjob finished after 0.00 h")


def test_system_exit_passes_through_with_its_status(tmp_path):
    with pytest.raises(SystemExit) as ei:
        with ExceptionMonitor(None, rank=0, run_dir=tmp_path):  # hard_exit=True: must not os._exit here
            raise SystemExit(2)
    assert ei.value.code == 2
    assert not (tmp_path / "crash_rank0.txt").exists()


SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from internlm_core.monitor.alert import AlertManager, WebhookSink
    from internlm_core.monitor.exception_monitor import ExceptionMonitor
    from internlm_core.utils.logging import setup_logging
    setup_logging(rank=0, run_dir=sys.argv[2])
    # a non-daemon thread that would keep a normal exit waiting forever
    threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    am = AlertManager([WebhookSink(sys.argv[1])], job_name="exitjob")
    with ExceptionMonitor(am, rank=0, run_dir=sys.argv[2], job_name="exitjob"):
        raise ValueError("bad value " + "x" * 3)
""")


def test_hard_exit_is_nonzero_and_prompt(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with WebhookReceiver() as rx:
        proc = subprocess.run([sys.executable, "-c", SCRIPT, rx.url, str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=60)
        bodies = rx.wait_for(2, timeout=5)
    assert proc.returncode == 1, proc.stderr
    assert [b["title"] for b in bodies] == ["[INFO] exitjob: training started",
                                            "[ERROR] exitjob: rank 0 failed: ValueError"]
    assert "ValueError: bad value xxx" in bodies[1]["content"]
    assert "Traceback (most recent call last)" in proc.stdout
    assert (tmp_path / "crash_rank0.txt").exists()
