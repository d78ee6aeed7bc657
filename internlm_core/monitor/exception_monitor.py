"""The exception monitor: wraps the whole run (as InternLM's `initialize_monitor_manager` / `internevo_monitor`).

    alerts = build_alert_manager(cfg.monitor, cfg.JOB_NAME, rank)
    with ExceptionMonitor(alerts, rank=rank, run_dir=run_dir, job_name=cfg.JOB_NAME):
        ...  # build and train

On entry rank 0 sends a start notice; on a clean exit rank 0 sends a finish notice. On an exception
on any rank it:

1. logs rank, host and the traceback (an `InternLMCoreError` gets its one-line message instead:
   the user can act on it without a traceback);
2. writes `crash_rank{N}.txt` into the run folder: time, rank, host, job, the traceback and the last
   lines of this rank's log file;
3. sends an alert with the last traceback lines (or the one-line message), then flushes the alert
   queue (at most `flush_timeout` seconds);
4. ends the process with exit status 1 *at once*, without waiting for the other ranks.

Why a hard exit (`os._exit(1)`) after aborting the process group: a normal exit runs atexit hooks and
joins non-daemon threads (data loader workers, an async checkpoint upload, NCCL's destroy), any of
which may block forever while a peer still waits in a collective; the job would then sit idle until
the collective timeout (30 minutes by default). Aborting this rank's communicators and exiting closes
its connections, so peers blocked in a collective with this rank fail at once (gloo: "Connection
closed by peer"; NCCL: the communicator error surfaces via async error handling) and go through
their own monitor; torchrun and `srun --kill-on-bad-exit=1` also tear the remaining ranks down when
one exits non-zero. Log handlers are flushed before the exit, so nothing written is lost.

`hard_exit=False` re-raises the exception after steps 1-3 instead (tests, notebooks). `SystemExit` is
not a crash: it passes through with its status (queued alerts are flushed first).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import time
import traceback
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

from internlm_core.errors import InternLMCoreError
from internlm_core.utils.logging import get_logger
from internlm_core.utils.redact import redact_text

from .alert import AlertManager, job_key

logger = get_logger(__name__)

TRACEBACK_LINES_IN_ALERT = 15
LOG_LINES_IN_REPORT = 50


def _log_files() -> list[Path]:
    """The files the package's log handlers write to (this rank's `rank{N}.log`)."""
    root = logging.getLogger("internlm_core")
    return [Path(h.baseFilename) for h in root.handlers if isinstance(h, logging.FileHandler)]


def flush_log_handlers() -> None:
    for h in logging.getLogger("internlm_core").handlers:
        try:
            h.flush()
        except Exception:  # noqa: BLE001 - a broken handler must not stop the crash path
            pass


def _tail(path: Path, n: int) -> list[str]:
    try:
        with open(path, "r", encoding="utf-8", errors="replace") as fh:
            return [line.rstrip("\n") for line in deque(fh, maxlen=n)]
    except OSError:
        return []


def abort_process_group() -> None:
    """Abort this rank's default process group if one is initialized (never blocks on peers)."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        from torch.distributed import distributed_c10d as c10d

        if hasattr(c10d, "_abort_process_group"):
            c10d._abort_process_group()
        # No fallback to destroy_process_group: with NCCL it can block on outstanding collectives.
    except Exception as e:  # noqa: BLE001 - best effort on the way out
        logger.warning("could not abort the process group: %s", e)


class ExceptionMonitor:
    """Context manager (and decorator via `monitored`) that reports and ends a failing run.

    Args:
        alerts: where alerts go (None: log and crash report only).
        rank: global rank of this process.
        run_dir: folder for `crash_rank{N}.txt` (None: no report file).
        job_name: names the job in notices and the report.
        world_size: shown in the start notice.
        flush_timeout: seconds to wait for queued alerts before exiting.
        hard_exit: end the process with `os._exit(1)` (True) or re-raise (False).
    """

    def __init__(self, alerts: Optional[AlertManager] = None, rank: int = 0, run_dir: str | Path | None = None,
                 job_name: str = "", world_size: int = 1, flush_timeout: float = 10.0, hard_exit: bool = True):
        self.alerts = alerts
        self.rank = rank
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.job_name = job_name
        self.world_size = world_size
        self.flush_timeout = flush_timeout
        self.hard_exit = hard_exit
        self.host = socket.gethostname()
        self.start_time = time.time()
        self.crash_report: Optional[Path] = None

    def _send(self, subject: str, content: str, level: str) -> None:
        if self.alerts is not None:
            self.alerts.send(subject, content, level=level)

    def __enter__(self) -> "ExceptionMonitor":
        self.start_time = time.time()
        if self.rank == 0:
            self._send("training started",
                       f"job {job_key(self.job_name)} started on {self.host} with {self.world_size} process(es)"
                       + (f"; run folder {self.run_dir}" if self.run_dir else ""), level="info")
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> bool:
        if exc is None:
            if self.rank == 0:
                hours = (time.time() - self.start_time) / 3600
                self._send("training finished", f"job {job_key(self.job_name)} finished after {hours:.2f} h",
                           level="info")
            if self.alerts is not None:
                self.alerts.flush(self.flush_timeout)
            return False
        if isinstance(exc, SystemExit):  # a deliberate exit (argparse, a tool): keep its status, no crash report
            if self.alerts is not None:
                self.alerts.flush(self.flush_timeout)
            return False
        self.handle(exc)
        if self.hard_exit:
            abort_process_group()
            flush_log_handlers()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        return False  # re-raise

    def handle(self, exc: BaseException) -> None:
        """Log, write the crash report and alert for `exc`, then flush the alert queue (steps 1-3)."""
        user_error = isinstance(exc, InternLMCoreError)
        tb_text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        one_line = f"{type(exc).__name__}: {exc}"
        where = f"rank {self.rank} on {self.host}"
        if user_error:
            logger.error("%s (%s)", one_line, where)
        else:
            logger.error("exception on %s:\n%s", where, tb_text.rstrip())
        try:
            self.crash_report = self.write_crash_report(tb_text)
        except OSError as e:
            logger.error("could not write the crash report: %s", e)
        if user_error:
            content = f"{where}: {one_line}"
        else:
            last = tb_text.rstrip().splitlines()[-TRACEBACK_LINES_IN_ALERT:]
            content = f"Exception on {where}:\n" + "\n".join(last)
        if self.crash_report is not None:
            content += f"\ncrash report: {self.crash_report}"
        self._send(f"rank {self.rank} failed: {type(exc).__name__}", content, level="error")
        if self.alerts is not None and not self.alerts.flush(self.flush_timeout):
            logger.warning("alerts still queued after %.0f s; exiting without them", self.flush_timeout)

    def write_crash_report(self, tb_text: str) -> Optional[Path]:
        if self.run_dir is None:
            return None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / f"crash_rank{self.rank}.txt"
        flush_log_handlers()
        lines = [
            f"time: {time.strftime('%Y-%m-%d %H:%M:%S %z')}",
            f"rank: {self.rank}",
            f"host: {self.host}",
            f"pid: {os.getpid()}",
            f"job: {job_key(self.job_name)}",
            "",
            "traceback:",
            tb_text.rstrip(),
        ]
        for log_file in _log_files():
            tail = _tail(log_file, LOG_LINES_IN_REPORT)
            if tail:
                lines += ["", f"last {len(tail)} lines of {log_file}:", *tail]
        path.write_text(redact_text("\n".join(lines) + "\n"), encoding="utf-8")  # a traceback may quote a secret
        return path


def monitored(alerts: Optional[AlertManager] = None, **monitor_kwargs: Any) -> Callable:
    """Decorator form: `@monitored(alerts, rank=rank, run_dir=run_dir)` runs the function under an ExceptionMonitor."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with ExceptionMonitor(alerts, **monitor_kwargs):
                return fn(*args, **kwargs)

        return inner

    return wrap
