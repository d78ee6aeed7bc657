"""Experiment trackers (`monitor.trackers`): adapters that receive every metrics.jsonl record from rank 0, one module
each behind the `Tracker` protocol (base.py), imported only when configured, run by the hub (hub.py) in background
threads that can never stop training."""

from __future__ import annotations

import importlib
import uuid
from typing import Any, Optional

from ...config.schema import TRACKERS
from ...utils import collectives
from ...utils.redact import redact_tree
from .base import RunInfo, Tracker
from .hub import TrackerHub

# monitor.trackers name → its adapter (module, class); the names are the config's (checked when it is loaded)
ADAPTERS = {"wandb": (".wandb", "WandbTracker"), "mlflow": (".mlflow", "MlflowTracker")}
if set(ADAPTERS) != set(TRACKERS):
    raise ImportError(f"monitor/trackers ADAPTERS {sorted(ADAPTERS)} must have one adapter for each name of "
                      f"config.schema.TRACKERS {sorted(TRACKERS)}")


def make_tracker(name: str) -> Tracker:
    """The adapter of `name` (its module imported now; the tracker's own package only when it opens)."""
    module, cls = ADAPTERS[name]
    return getattr(importlib.import_module(module, __name__), cls)()


def build_trackers(monitor_cfg: Any, job_name: str, config: dict, rank: int, distributed: bool, run_dir: str,
                   run_name: Optional[str] = None) -> Optional[TrackerHub]:
    """The hub of `monitor.trackers` (None when none is named). Every rank builds one, holding rank 0's new run key
    (a collective when `distributed`: the key is checkpoint state and must be the same everywhere); only rank 0
    sends. `config`: the resolved config as plain dicts, logged once with its secrets redacted (utils/redact.py)."""
    names = list(dict.fromkeys(monitor_cfg.trackers))
    if not names:
        return None
    box = [uuid.uuid4().hex if rank == 0 else ""]
    if distributed:
        collectives.broadcast_object_list(box, src=0)
    run = RunInfo(key=box[0], project=monitor_cfg.tracker_project or job_name, name=run_name or job_name,
                  run_dir=str(run_dir), config=redact_tree(config), timeout_s=float(monitor_cfg.tracker_timeout))
    return TrackerHub([make_tracker(n) for n in names] if rank == 0 else [], run, active=rank == 0)


__all__ = ["ADAPTERS", "RunInfo", "Tracker", "TrackerHub", "build_trackers", "make_tracker"]
