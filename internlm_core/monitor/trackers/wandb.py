"""Weights & Biases: one wandb run per training run, its id the run key (a resumed run continues it). Configured by
wandb's own variables (WANDB_MODE=offline, WANDB_DIR, WANDB_API_KEY, WANDB_BASE_URL, WANDB_ENTITY, ...); the run's
files go to the run folder unless WANDB_DIR says otherwise. Imported only when `monitor.trackers` names it.

wandb gets only redacted values: the config (redacted by the hub), and nothing it would capture by itself: no
system metadata (`x_disable_meta`: command line, program, host, git state), no git, no code, no console; the
command line it still reads (Settings' `_args`, which goes into the run file) is the redacted one while it starts."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, Optional

from ...utils.redact import redact_argv

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
        settings = wandb.Settings(init_timeout=run.timeout_s, console="off", silent=True, x_disable_meta=True,
                                  disable_git=True, disable_code=True, save_code=False, x_disable_machine_info=True)
        kwargs: dict[str, Any] = {}
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = run.run_dir
        with _redacted_argv():
            self._run = wandb.init(project=run.project, name=run.name, id=run.key, resume="allow",
                                   config=None if run.resumed else run.config, settings=settings, **kwargs)
        return str(self._run.dir if self._run.offline else self._run.url)

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


@contextlib.contextmanager
def _redacted_argv() -> Iterator[None]:
    """sys.argv with its secrets redacted (utils.redact.redact_argv) while wandb reads it, then the real one."""
    real = sys.argv
    sys.argv = redact_argv(real)
    try:
        yield
    finally:
        sys.argv = real
