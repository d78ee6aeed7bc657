"""What a restart cost: a `restart` record in metrics.jsonl, a log line and an alert when a run starts again
(torchrun's elastic restart, SLURM's requeue, or by hand) in a run folder that already holds metrics.

    callbacks.add(RestartReporter(run_dir, rank, restart_count=launch.restart_count, max_restarts=..., alerts=...))

At train start (after the resume), rank 0 reads the tail of metrics.jsonl: the last step recorded before the
failure and when (the file's modification time). It appends

    {"kind": "restart", "step": S, "restart": N, "last_step": P, "steps_to_retrain": P - S, "down_s": ...}

where S is the step the run resumed from: every record after it supersedes the records of steps > S written
before it (`tools/plot_metrics.py` reads the file that way), so the last record of each step is the one that
counts. Once training is back at step P, it logs and alerts the time lost: from the last record before the
failure to the same step again (down time and training again).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from internlm_core.callbacks import StepView, TrainerCallback
from internlm_core.utils.logging import get_logger
from internlm_core.utils.writer import MetricsWriter

from .alert import AlertManager

logger = get_logger(__name__)

_TAIL_BYTES = 1 << 16


def last_train_record(path: Path) -> Optional[tuple[int, float]]:
    """(step of the last train record, modification time) of a metrics.jsonl, or None when it holds none."""
    try:
        size = path.stat().st_size
        mtime = path.stat().st_mtime
        with open(path, "rb") as f:
            f.seek(max(0, size - _TAIL_BYTES))
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("kind") == "train" and isinstance(rec.get("step"), int):
            return rec["step"], mtime
    return None


def _end_line(path: Path) -> None:
    """A line cut short by the failure is ended, so that the next record starts on a line of its own."""
    try:
        with open(path, "rb+") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
    except OSError:
        pass


class RestartReporter(TrainerCallback):
    """Marks, logs and alerts a restart (see the module docstring).

    Args:
        run_dir: the run folder (its metrics.jsonl).
        rank: rank 0 writes, logs and alerts.
        restart_count: the launcher's restart count (LaunchInfo.restart_count).
        max_restarts: torchrun's --max-restarts, when known.
        alerts: where the alerts go (None: log only).
        replica_group: this run's replica group (parallel.fault_tolerance.replica_id; None: not one of several).
            A replica group that restarts resumes its own checkpoint first, then heals from a live peer at its first
            quorum when one is ahead: which steps it trains again is only known then, and said then
            (trainer/replicated.record_heal: a log line and a `heal` record).
    """

    def __init__(self, run_dir: str | Path, rank: int = 0, restart_count: int = 0,
                 max_restarts: Optional[int] = None, alerts: Optional[AlertManager] = None,
                 writer: Optional[MetricsWriter] = None, replica_group: Optional[int] = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.replica_group = replica_group
        self.rank, self.restart_count, self.max_restarts, self.alerts = rank, restart_count, max_restarts, alerts
        self.writer = writer  # the run's metrics writer (the restart record goes beside the steps')
        self.previous: Optional[tuple[int, float]] = None
        self.resumed_step = 0
        self.record: Optional[dict] = None

    def _alert(self, subject: str, content: str) -> None:
        if self.alerts is not None:
            self.alerts.send(subject, content, level="warning")

    def on_train_start(self, view: StepView) -> None:
        if self.rank != 0:
            return
        self.previous = last_train_record(self.path)
        self.resumed_step = int(view.step)
        if self.previous is None:
            if self.restart_count:
                logger.warning("restart %d: no step was recorded before it; training from step %d",
                               self.restart_count, self.resumed_step)
            return
        last, when = self.previous
        down = max(0.0, time.time() - when)
        retrain = max(0, last - self.resumed_step)
        loaded = view.resumed_from
        self.record = {"restart": self.restart_count, "last_step": last, "steps_to_retrain": retrain,
                       "down_s": round(down, 1), "checkpoint": loaded,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        if self.max_restarts is not None:
            self.record["max_restarts"] = self.max_restarts
        if self.replica_group is not None:
            self.record["replica_group"] = self.replica_group
        _end_line(self.path)
        if self.writer is not None:
            self.writer.write(self.resumed_step, dict(self.record), kind="restart")
        of = f" of at most {self.max_restarts}" if self.max_restarts is not None else ""
        msg = (f"restart {self.restart_count}{of}: the run stopped after step {last} {down:.0f} s ago; resumed from "
               f"step {self.resumed_step}" + (f" ({loaded})" if loaded is not None else "") +
               (self._retrain_clause(last) if retrain else ""))
        if self.restart_count or retrain:
            logger.warning(msg)
            self._alert(f"run restarted at step {self.resumed_step} (restart {self.restart_count})", msg)
        else:
            logger.info(msg)
        if retrain == 0:
            self.previous = None

    def _retrain_clause(self, last: int) -> str:
        first = self.resumed_step + 1
        if self.replica_group is None:
            return f"; steps {first}-{last} are trained again"
        return (f"; replica group {self.replica_group}: steps {first}-{last} are trained again unless a live group is "
                f"ahead (then it heals from it at its first quorum and logs the step it continues from)")

    def _caught_up(self, step: int) -> None:
        _, when = self.previous
        lost = max(0.0, time.time() - when)
        msg = (f"restart {self.restart_count}: back at step {step}; the failure cost {lost:.0f} s (from the last "
               f"step recorded before it to the same step again)")
        logger.warning(msg)
        self._alert(f"run recovered at step {step}: {lost:.0f} s lost", msg)
        self.previous = None

    def on_step_end(self, view: StepView, metrics: Mapping[str, Any]) -> None:
        if self.rank == 0 and self.previous is not None and int(metrics.get("step", 0)) >= self.previous[0]:
            self._caught_up(int(metrics["step"]))
