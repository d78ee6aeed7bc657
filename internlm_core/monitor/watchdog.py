"""Hang watchdog: alert and dump every thread's Python stack when no step completes in time.

    watchdog = build_watchdog(cfg.monitor, alerts, rank)   # None when monitor.hang_timeout <= 0
    callbacks.add(watchdog)                                 # start on train start, beat per step, stop at end

`beat()` marks progress (the callback calls it at each step end, after validation and after a save).
The clock starts at `start()`, so the first step (compilation, warm-up) must also finish within
`hang_timeout`. When `hang_timeout` seconds pass without a beat, the watchdog logs the stacks of all
threads (warning level, this rank's log) and sends an alert (rank 0 only by default: with a hung
collective every rank stalls, and one alert per job is enough; every rank still logs its stacks).
It keeps watching and fires again only after another full `hang_timeout` without a beat; when a beat
finally comes, it logs how long the stall lasted.

`monitor.hang_action="exit"` ends the process instead, after the stacks and the alert (flushed, at most 10 s):
its process group is aborted and it exits with status `HANG_EXIT_CODE`, so peers waiting on it in a collective fail
at once, and a launcher (torchrun `--max-restarts`, SLURM `--requeue`) restarts the group from the newest complete
checkpoint instead of leaving it stalled.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Mapping, Optional

from internlm_core.callbacks import StepView, TrainerCallback
from internlm_core.utils.logging import get_logger

from .alert import AlertManager
from .exception_monitor import abort_process_group, flush_log_handlers

logger = get_logger(__name__)

HANG_EXIT_CODE = 3  # the exit status of a process ended by the watchdog (hang_action "exit")
HANG_ACTIONS = ("alert", "exit")


def format_all_stacks() -> str:
    """The current Python stack of every thread, most recent call last (like faulthandler, but as text)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        parts.append(f"Thread {names.get(ident, '?')} (id {ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class HangWatchdog(TrainerCallback):
    """A daemon thread that fires when `beat()` was not called for `timeout` seconds.

    Args:
        timeout: seconds without a beat before firing (> 0).
        alerts: where the alert goes (None: log only).
        rank: this process's rank.
        alert_all_ranks: alert from every rank instead of rank 0 only.
        action: "alert" (keep watching) or "exit" (end the process with HANG_EXIT_CODE after alerting).
    """

    def __init__(self, timeout: float, alerts: Optional[AlertManager] = None, rank: int = 0,
                 alert_all_ranks: bool = False, action: str = "alert"):
        if timeout <= 0:
            raise ValueError(f"hang watchdog timeout: expected > 0 seconds, got {timeout}")
        if action not in HANG_ACTIONS:
            raise ValueError(f"monitor.hang_action: expected one of {', '.join(HANG_ACTIONS)}, got {action!r}")
        self.action = action
        self.timeout = float(timeout)
        self.alerts = alerts
        self.rank = rank
        self.alert_all_ranks = alert_all_ranks
        self.fired = 0
        self.last_step: Optional[int] = None
        self._last_beat = time.monotonic()
        self._last_fire: Optional[float] = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # -- control ---------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._last_beat = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: Optional[int] = None) -> None:
        """Mark progress; cheap (a clock read and a lock), safe to call every step."""
        now = time.monotonic()
        with self._lock:
            stalled_for = now - self._last_beat if self._last_fire is not None else None
            self._last_beat = now
            self._last_fire = None
            if step is not None:
                self.last_step = step
        if stalled_for is not None:
            logger.warning("hang watchdog: progress again%s after %.1f s without a step",
                           f" at step {step}" if step is not None else "", stalled_for)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> "HangWatchdog":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._lock:
                ref = self._last_fire if self._last_fire is not None else self._last_beat
            wait = ref + self.timeout - time.monotonic()
            if wait > 0:
                if self._stop.wait(wait):  # a beat meanwhile moves the deadline: re-read it on waking
                    return
                continue
            if self._stop.is_set():
                return
            with self._lock:
                # a beat may have landed between the read above and here
                ref = self._last_fire if self._last_fire is not None else self._last_beat
                if time.monotonic() - ref < self.timeout:
                    continue
                since = time.monotonic() - self._last_beat
                self._last_fire = time.monotonic()
            try:
                self._fire(since)
            except Exception as e:  # noqa: BLE001 - the watchdog must keep watching
                logger.error("hang watchdog failed to report: %s", e)
            if self.action == "exit":
                self._exit(since)

    def _fire(self, since: float) -> None:
        self.fired += 1
        host = socket.gethostname()
        after = f" after step {self.last_step}" if self.last_step is not None else ""
        msg = f"no training step completed for {since:.0f} s{after} (hang_timeout {self.timeout:g} s)"
        stacks = format_all_stacks()
        logger.warning("hang watchdog: %s; Python stacks of all threads on rank %d (%s):\n%s",
                       msg, self.rank, host, stacks)
        if self.alerts is not None and (self.rank == 0 or self.alert_all_ranks):
            main = threading.main_thread()
            frame = sys._current_frames().get(main.ident)
            main_stack = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else ""
            then = (f" Ending the process (exit status {HANG_EXIT_CODE}) so that the launcher restarts the job."
                    if self.action == "exit" else "")
            self.alerts.send("training may be hung",
                             f"{msg} on rank {self.rank} ({host}).{then} Main thread:\n{main_stack}"
                             "All stacks are in the rank logs.", level="error")

    def _exit(self, since: float) -> None:
        """hang_action "exit": flush the alerts, abort the process group, end the process."""
        logger.error("hang watchdog: ending rank %d after %.0f s without a step (monitor.hang_action=exit); exit "
                     "status %d", self.rank, since, HANG_EXIT_CODE)
        if self.alerts is not None:
            self.alerts.flush(10.0)
        abort_process_group()
        flush_log_handlers()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(HANG_EXIT_CODE)

    # -- trainer callback ------------------------------------------------------------------------------
    def on_train_start(self, view: StepView) -> None:
        self.start()

    def on_step_end(self, view: StepView, metrics: Mapping[str, Any]) -> None:
        self.beat(metrics.get("step"))

    def on_validation_end(self, view: StepView, metrics: Mapping[str, Any]) -> None:
        self.beat()

    def on_save(self, view: StepView, step: int, path: str) -> None:
        self.beat()

    def on_train_end(self, view: StepView) -> None:
        self.stop()


INTERNLM_HANG_TIMEOUT_S = 300.0  # InternLM's monitor_interval_seconds with alerts on


def build_watchdog(monitor_cfg: Any, alerts: Optional[AlertManager] = None, rank: int = 0) -> Optional[HangWatchdog]:
    """A HangWatchdog from `cfg.monitor.hang_timeout`; None when it is 0 (off). Unset (None): InternLM's 300 s
    when alerts go somewhere, else off. `monitor.hang_action`: alert only, or alert and exit."""
    timeout = monitor_cfg.hang_timeout
    if timeout is None:
        timeout = INTERNLM_HANG_TIMEOUT_S if alerts is not None and alerts.enabled else 0
    timeout = float(timeout or 0)
    action = monitor_cfg.hang_action
    return HangWatchdog(timeout, alerts=alerts, rank=rank, action=action) if timeout > 0 else None
