"""Alert senders: Feishu webhook (InternLM's message format), a generic JSON webhook, a JSON-lines file.

Sending never blocks training: `AlertManager.send` only puts the alert on a bounded queue; one
daemon thread delivers it to every destination with a per-request timeout and a bounded number of
retries with exponential backoff. When the queue is full the alert is dropped and counted (with a
warning in the log). `flush(timeout)` waits, at most `timeout` seconds, for the queue to drain;
the exception monitor calls it before the process exits.

Webhook addresses carry tokens: they are never logged. The log says which destinations are
configured ("feishu webhook configured: yes") and errors are reported with the address redacted.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from internlm_core.utils.logging import get_logger
from internlm_core.utils.redact import redact_text

logger = get_logger(__name__)

FEISHU_ENV = "INTERNLM_FEISHU_ALERT_ADDRESS"
WEBHOOK_ENV = "INTERNLM_ALERT_WEBHOOK"

LEVELS = ("info", "warning", "error")


def job_key(job_name: Optional[str] = None) -> str:
    """The job as alert titles name it: `JOB_NAME` (argument, else env JOB_NAME) and the SLURM job id when set."""
    name = job_name or os.environ.get("JOB_NAME") or "internlm_core"
    slurm = os.environ.get("SLURM_JOB_ID")
    return f"{name} (slurm {slurm})" if slurm else name


@dataclass
class Alert:
    """One alert. `title` is the full title (job key and subject); `content` the body text."""

    title: str
    content: str
    level: str = "error"
    job: str = ""
    rank: int = 0
    host: str = field(default_factory=socket.gethostname)
    slurm_job_id: Optional[str] = field(default_factory=lambda: os.environ.get("SLURM_JOB_ID"))
    time: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))


class DeliveryError(Exception):
    """A destination did not accept an alert; `retriable` says whether trying again may help."""

    def __init__(self, message: str, retriable: bool = True):
        super().__init__(message)
        self.retriable = retriable


class AlertSink:
    """One destination. `deliver` raises DeliveryError (or any OSError) when the alert was not accepted."""

    name = "sink"

    def deliver(self, alert: Alert, timeout: float) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        """What the log may say about this destination (never the address itself)."""
        return f"{self.name}: yes"


def _post_json(url: str, payload: dict, timeout: float) -> bytes:
    data = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json;charset=utf-8"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - the URL is the user's webhook
            return resp.read()
    except urllib.error.HTTPError as e:
        # 5xx and 429 may pass; other 4xx mean the request itself is wrong.
        raise DeliveryError(f"HTTP {e.code}", retriable=e.code >= 500 or e.code == 429) from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise DeliveryError(f"{type(reason).__name__}: {reason}") from None


class WebhookSink(AlertSink):
    """A generic JSON webhook: POST {"title","content","job","rank","host","slurm_job_id","level","time"}."""

    name = "json webhook"

    def __init__(self, url: str):
        self.url = url

    def deliver(self, alert: Alert, timeout: float) -> None:
        _post_json(self.url, asdict(alert), timeout)


class FeishuSink(AlertSink):
    """A Feishu (Lark) bot webhook, in InternLM's format: msg_type "post" (default) or "interactive" (a card)."""

    name = "feishu webhook"

    def __init__(self, url: str, msg_type: str = "post"):
        if msg_type not in ("post", "interactive"):
            raise ValueError(f"feishu msg_type: expected 'post' or 'interactive', got {msg_type!r}")
        self.url = url
        self.msg_type = msg_type

    def payload(self, alert: Alert) -> dict:
        text = f"{alert.content}\n\nrank {alert.rank} on {alert.host} at {alert.time}"
        if self.msg_type == "post":
            return {
                "timestamp": int(time.time()),
                "msg_type": "post",
                "content": {"post": {"zh_cn": {"title": alert.title,
                                               "content": [[{"tag": "text", "text": text}]]}}},
            }
        color = {"info": "blue", "warning": "orange", "error": "red"}.get(alert.level, "red")
        return {
            "timestamp": int(time.time()),
            "msg_type": "interactive",
            "card": {
                "config": {"wide_screen_mode": True},
                "header": {"template": color, "title": {"tag": "plain_text", "content": alert.title}},
                "elements": [{"tag": "div", "text": {"tag": "plain_text", "content": text}}],
            },
        }

    def deliver(self, alert: Alert, timeout: float) -> None:
        body = _post_json(self.url, self.payload(alert), timeout)
        try:  # Feishu answers 200 with {"code": non-zero, "msg": ...} when it refuses a message
            code = json.loads(body or b"{}").get("code", 0)
        except (ValueError, AttributeError):
            code = 0
        if code:
            raise DeliveryError(f"feishu refused the message (code {code})")


class FileSink(AlertSink):
    """Append each alert as one JSON line to a file (written by the sender thread, like the webhooks)."""

    name = "alert file"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def describe(self) -> str:
        return f"alert file: {self.path}"

    def deliver(self, alert: Alert, timeout: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(asdict(alert), ensure_ascii=False) + "\n")


_STOP = object()


class AlertManager:
    """Queues alerts and delivers them from one background thread.

    Args:
        sinks: destinations; with none, `send` does nothing (and no thread is started).
        job_name: `JOB_NAME` for titles (env JOB_NAME when empty).
        rank: this process's global rank, carried in every alert.
        timeout: seconds per HTTP request.
        max_retries: extra attempts per destination after a retriable failure.
        backoff: seconds before the first retry; doubled for each further one.
        queue_size: alerts waiting at most; more are dropped (and counted in `dropped`).
    """

    def __init__(self, sinks: Sequence[AlertSink] = (), job_name: str = "", rank: int = 0, timeout: float = 5.0,
                 max_retries: int = 2, backoff: float = 1.0, queue_size: int = 64):
        self.sinks = list(sinks)
        self.job_name = job_name
        self.rank = rank
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.dropped = 0
        self.delivered = 0
        self.failed = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._closed = False
        self._wake = threading.Event()  # set on close: cuts retry backoff short
        self._thread: Optional[threading.Thread] = None
        if self.sinks:
            self._thread = threading.Thread(target=self._run, name="alert-sender", daemon=True)
            self._thread.start()

    @property
    def enabled(self) -> bool:
        return bool(self.sinks)

    def describe(self) -> str:
        return ", ".join(s.describe() for s in self.sinks) if self.sinks else "no alert destination configured"

    def send(self, subject: str, content: str, level: str = "error") -> bool:
        """Queue an alert; returns at once. False when there is no destination, it is closed, or the queue is full."""
        if not self.sinks or self._closed:
            return False
        if level not in LEVELS:
            level = "error"
        title = redact_text(f"[{level.upper()}] {job_key(self.job_name)}: {subject}")
        alert = Alert(title=title, content=redact_text(content), level=level,
                      job=self.job_name or os.environ.get("JOB_NAME", ""),
                      rank=self.rank)
        try:
            self._queue.put_nowait(alert)
        except queue.Full:
            self.dropped += 1
            logger.warning("alert queue full (%d waiting); dropped alert %r", self._queue.maxsize, subject)
            return False
        return True

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait up to `timeout` seconds until every queued alert was delivered or given up; True if drained."""
        if self._thread is None:
            return True
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float = 10.0) -> bool:
        """Flush (up to `timeout`), then stop the sender thread. Further `send` calls return False."""
        if self._thread is None or self._closed:
            return True
        drained = self.flush(timeout)
        self._closed = True
        self._wake.set()
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:
            pass  # the thread is a daemon; it dies with the process
        self._thread.join(timeout=max(0.0, min(1.0, timeout)))
        return drained

    def _redact(self, text: str) -> str:
        for s in self.sinks:
            url = getattr(s, "url", None)
            if url:
                text = text.replace(url, "<redacted>")
        return text

    def _deliver(self, sink: AlertSink, alert: Alert) -> None:
        for attempt in range(self.max_retries + 1):
            try:
                sink.deliver(alert, self.timeout)
                self.delivered += 1
                return
            except (DeliveryError, OSError) as e:
                retriable = getattr(e, "retriable", True)
                last = attempt == self.max_retries or not retriable
                logger.warning("alert to %s failed (attempt %d/%d): %s%s", sink.name, attempt + 1,
                               self.max_retries + 1, self._redact(str(e)), "" if last else "; retrying")
                if last:
                    self.failed += 1
                    return
                if self._wake.wait(self.backoff * (2 ** attempt)):
                    self.failed += 1
                    return
            except Exception as e:  # noqa: BLE001 - a bug in a sink must not kill the sender thread
                logger.warning("alert to %s failed: %s", sink.name, self._redact(f"{type(e).__name__}: {e}"))
                self.failed += 1
                return

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                for sink in self.sinks:
                    self._deliver(sink, item)
            finally:
                self._queue.task_done()


def build_alert_manager(monitor_cfg: Any, job_name: str = "", rank: int = 0, **kwargs: Any) -> AlertManager:
    """An AlertManager from `cfg.monitor` (MonitorConfig): its `alert` section, addresses falling back to the env.

    Feishu: on when `alert.enable_feishu_alert`, address from `alert.feishu_alert_address` or env
    INTERNLM_FEISHU_ALERT_ADDRESS. JSON webhook: `alert.webhook_url` or env INTERNLM_ALERT_WEBHOOK.
    File: `alert.alert_file_path`. Extra keyword arguments go to AlertManager (timeout, max_retries, ...).
    """
    alert_cfg = monitor_cfg.alert
    sinks: list[AlertSink] = []
    if alert_cfg.enable_feishu_alert:
        address = alert_cfg.feishu_alert_address or os.environ.get(FEISHU_ENV)
        if address:
            sinks.append(FeishuSink(address))
        else:
            logger.warning("monitor.alert.enable_feishu_alert is set but no address is given "
                           "(monitor.alert.feishu_alert_address or env %s); Feishu alerts are off", FEISHU_ENV)
    webhook = alert_cfg.webhook_url or os.environ.get(WEBHOOK_ENV)
    if webhook:
        sinks.append(WebhookSink(webhook))
    path = alert_cfg.alert_file_path
    if path:
        sinks.append(FileSink(path))
    manager = AlertManager(sinks, job_name=job_name, rank=rank, **kwargs)
    if rank == 0:
        names = {s.name for s in sinks}
        logger.info("alerts: feishu webhook configured: %s, json webhook configured: %s%s",
                    "yes" if "feishu webhook" in names else "no", "yes" if "json webhook" in names else "no",
                    f", alert file: {path}" if path else "")
    return manager
