"""The trackers of one run behind the metrics writer: each in its own background thread with a bounded queue, so
that a tracker that is slow, hangs or cannot be reached never costs the training a step.

    hub = TrackerHub(trackers, run)      # every rank builds it (its key is checkpoint state); rank 0 is active
    manager.register("trackers", hub, content="sampler", strict=False)   # the key survives a restart
    manager.resume(); hub.start()        # opens each tracker in its thread, continuing a resumed run
    MetricsWriter(..., sinks=[hub])      # every metrics.jsonl record also goes to each tracker
    writer.close()                       # sends what is queued (at most run.timeout_s), finishes the runs

A failure (import, connection, a refused record) is one warning per tracker; a full queue drops the record and
counts it (one warning, the count at the end).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any, Mapping, Optional

from ...utils.logging import get_logger
from .base import RunInfo, Tracker, numeric_values

logger = get_logger(__name__)
_STOP = object()


class _Worker:
    """One tracker, its queue and its thread."""

    def __init__(self, tracker: Tracker, queue_size: int):
        self.tracker = tracker
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self.thread: Optional[threading.Thread] = None
        self.failed = False      # warned; nothing more is sent
        self.opened = False
        self.dropped = 0         # records not queued: the queue was full
        self.sent = 0

    def warn(self, what: str, error: BaseException) -> None:
        """The one warning of this tracker; it sends nothing more."""
        if not self.failed:
            self.failed = True
            logger.warning("tracker %s: %s failed (%s: %s); training goes on without it", self.tracker.name, what,
                           type(error).__name__, error)

    def run(self, info: RunInfo) -> None:
        """The thread: open, then send records until _STOP; a failure stops the sending, not the draining."""
        try:
            where = self.tracker.open(info)
            self.opened = True
            logger.info("tracker %s: %s run %s (%s)", self.tracker.name, "continuing" if info.resumed else "started",
                        info.key, where)
        except BaseException as e:  # noqa: BLE001 - an adapter's failure of any kind must not reach training
            self.warn("connecting", e)
        while True:
            item = self.queue.get()
            if item is _STOP:
                break
            if self.failed:
                continue  # drained so that send() never finds the queue full because of a dead tracker
            try:
                self.tracker.log(*item)
                self.sent += 1
            except BaseException as e:  # noqa: BLE001
                self.warn(f"sending step {item[0]}", e)
        if self.opened and not self.failed:
            try:
                self.tracker.close()
            except BaseException as e:  # noqa: BLE001
                self.warn("finishing the run", e)


class TrackerHub:
    """Fans metrics records out to the trackers (rank 0 only) and keeps their run key as checkpoint state.

    trackers: the adapters (not yet opened). run: the run to open; its key is replaced by a checkpoint's at
    `load_state_dict`. active: this process sends (rank 0); elsewhere the hub only carries the key.
    """

    def __init__(self, trackers: list[Tracker], run: RunInfo, active: bool, queue_size: int = 1024):
        self.run = run
        self.active = active
        self._workers = [_Worker(t, queue_size) for t in trackers] if active else []
        self._started = False
        self._warned_full = False

    @property
    def names(self) -> list[str]:
        return [w.tracker.name for w in self._workers]

    # ---- checkpoint state: the same on every rank (rank 0's key, broadcast when the run started) ----------------
    def state_dict(self) -> dict[str, str]:
        return {"run_id": self.run.key}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A checkpoint's key: the trackers continue that run (its config was logged when it started)."""
        key = str(state.get("run_id") or "")
        if key and not self._started:
            self.run = dataclasses.replace(self.run, key=key, resumed=True)

    # ---- sending ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Import the trackers' packages here, then open each tracker in its own thread (after any resume: the run
        key is final)."""
        if self._started:
            return
        self._started = True
        for w in self._workers:
            try:
                w.tracker.prepare()
            except BaseException as e:  # noqa: BLE001 - e.g. the package is not installed
                w.warn("importing its package", e)
                continue
            w.thread = threading.Thread(target=w.run, args=(self.run,), name=f"tracker-{w.tracker.name}",
                                        daemon=True)
            w.thread.start()

    def send(self, record: Mapping[str, Any]) -> None:
        """Queue one metrics.jsonl record for every tracker; never blocks (a full queue drops it, counted)."""
        if not self._workers:
            return
        item = (int(record.get("step", 0)), numeric_values(record))
        for w in self._workers:
            if w.failed:
                continue
            try:
                w.queue.put_nowait(item)
            except queue.Full:
                w.dropped += 1
                if not self._warned_full:
                    self._warned_full = True
                    logger.warning("tracker %s is not keeping up: its queue of %d records is full; records are "
                                   "dropped (counted) until it catches up", w.tracker.name, w.queue.maxsize)

    def close(self) -> None:
        """Send what is queued and finish each tracker's run, waiting at most `run.timeout_s` in all."""
        if not self._started:
            return
        deadline = time.monotonic() + self.run.timeout_s
        for w in self._workers:
            _put_stop(w.queue, deadline)
        for w in self._workers:
            if w.thread is not None:
                w.thread.join(max(0.0, deadline - time.monotonic()))
            late = w.thread is not None and w.thread.is_alive()
            note = (f"{w.sent} records sent, {w.dropped} dropped (queue full), {w.queue.qsize()} not sent"
                    + (f" (still busy after {self.run.timeout_s:g} s: left behind)" if late else ""))
            if late and not w.failed:
                w.failed = True
                logger.warning("tracker %s: %s", w.tracker.name, note)
            else:
                logger.info("tracker %s: %s", w.tracker.name, note)
        self._workers = []


def _put_stop(q: queue.Queue, deadline: float) -> None:
    """The end mark behind the queued records (waiting for room until `deadline`; a stuck tracker gets none)."""
    try:
        q.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
    except queue.Full:
        pass
