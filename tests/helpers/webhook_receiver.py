"""A loopback JSON webhook receiver, for tests of the alert path (and to try alert settings by hand).

    with WebhookReceiver() as rx:          # 127.0.0.1, a free port
        ... send alerts to rx.url ...
        bodies = rx.wait_for(1)            # the POSTed JSON bodies

`status` makes it answer with that HTTP status; `delay` makes it hold each request that long before
answering (a hung server; `stop()` releases held requests).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 (a free port) that records every POSTed JSON body in `received`."""

    def __init__(self, status: int = 200, delay: float = 0.0, port: int = 0):
        self.status = status
        self.delay = delay
        self.received: list[Any] = []
        self.request_times: list[float] = []
        self._cond = threading.Condition()
        self._release = threading.Event()
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    payload: Any = json.loads(body or b"null")
                except ValueError:
                    payload = body.decode("utf-8", "replace")
                with rx._cond:
                    rx.received.append(payload)
                    rx.request_times.append(time.monotonic())
                    rx._cond.notify_all()
                if rx.delay:
                    rx._release.wait(rx.delay)
                answer = json.dumps({"code": 0} if rx.status < 400 else {"error": rx.status}).encode()
                try:
                    self.send_response(rx.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)
                except OSError:
                    pass  # the client gave up (its timeout) before the answer

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def start(self) -> "WebhookReceiver":
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="webhook-receiver",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def wait_for(self, count: int, timeout: float = 10.0) -> list[Any]:
        """Wait until at least `count` requests arrived (or `timeout`); returns what arrived."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.received) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return list(self.received)

    def __enter__(self) -> "WebhookReceiver":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
