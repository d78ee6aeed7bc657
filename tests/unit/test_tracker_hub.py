"""The tracker hub never makes training wait: an mlflow server that accepts connections and never answers keeps the
tracker's thread busy while every record is queued or dropped (counted) at once; the hub warns and lets it go.
An unknown tracker name is one config error."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from internlm_core.config import load_config
from internlm_core.errors import ConfigError
from internlm_core.monitor.trackers import RunInfo, TrackerHub, make_tracker
from tests.helpers.launch import ROOT


class BlackHole:
    """A loopback TCP server that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()


def test_a_hanging_tracker_never_blocks_send_and_drops_what_does_not_fit(monkeypatch, caplog):
    server = BlackHole()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{server.port}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    run = RunInfo(key="k", project="p", name="n", run_dir="", timeout_s=1.0)
    hub = TrackerHub([make_tracker("mlflow")], run, active=True, queue_size=8)
    worker = hub._workers[0]
    try:
        with caplog.at_level(logging.INFO, logger="internlm_core.monitor.trackers.hub"):
            hub.start()
            for step in range(1, 101):
                hub.send({"kind": "train", "step": step, "loss": 1.0 / step, "skipped": False})
            # every send returned while the tracker is still connecting (3 s request timeout)
            assert worker.thread.is_alive() and not worker.opened and worker.sent == 0
            assert worker.dropped == 100 - 8 and worker.queue.qsize() == 8
            hub.close()  # waits at most run.timeout_s, then leaves the stuck thread behind
    finally:
        server.close()
    # the hub's own warnings: a thread another test left behind (an S3 lease retry, say) may log in between
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name.startswith("internlm_core.monitor.trackers")]
    assert len(warnings) == 2, warnings
    assert warnings[0] == ("tracker mlflow is not keeping up: its queue of 8 records is full; records are dropped "
                           "(counted) until it catches up")
    assert warnings[1].startswith("tracker mlflow: 0 records sent, 92 dropped (queue full)")


def test_an_unknown_tracker_is_a_config_error():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny.py", ['monitor.trackers=["wandb", "tensorboard"]'])
    assert str(e.value).endswith("monitor.trackers: unknown ['tensorboard']; expected any of wandb, mlflow")
