"""Weights & Biases: one wandb run per training run, its id the run key (a resumed run continues it). Configured by
wandb's own variables (WANDB_MODE=offline, WANDB_DIR, WANDB_API_KEY, WANDB_BASE_URL, WANDB_ENTITY, ...); the run's
files go to the run folder unless WANDB_DIR says otherwise. Imported only when `monitor.trackers` names it."""

from __future__ import annotations

import os
from typing import Any, Optional

from .base import RunInfo


class WandbTracker:
    """The `Tracker` for wandb (see base.py)."""

    name = "wandb"

    def __init__(self) -> None:
        self._run: Optional[Any] = None

    def prepare(self) -> None:
        import wandb  # noqa: F401 - the optional dependency, only here

    def open(self, run: RunInfo) -> str:
        import wandb

        # console capture off: the run folder has the logs, and wandb must not wrap the process's stdout from a
        # background thread; init_timeout bounds the connection attempt
        settings = wandb.Settings(init_timeout=run.timeout_s, console="off", silent=True)
        kwargs: dict[str, Any] = {}
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = run.run_dir
        self._run = wandb.init(project=run.project, name=run.name, id=run.key, resume="allow",
                               config=None if run.resumed else run.config, settings=settings, **kwargs)
        return str(self._run.dir if self._run.offline else self._run.url)

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
