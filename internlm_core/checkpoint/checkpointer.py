"""The checkpoint manager as a trainer callback: periodic saves, stop requests, the final save, waiting at the end;
no save while the loss is unhealthy."""

from __future__ import annotations

from typing import Any, Optional

from ..callbacks import TrainerCallback
from ..utils.logging import get_logger
from . import events
from .manager import CheckpointManager

logger = get_logger(__name__)


class CheckpointCallback(TrainerCallback):
    """Saves after a step when `checkpoint_every` / `oss_snapshot_freq` say so or `trainer.stop_request.save`
    is set (by the StopController, which must come before this callback in the list), and at the end of
    training (`save_at_end`, or a stop request whose save was not taken yet); then waits for the background
    write/upload and raises CheckpointError if the last checkpoint did not complete.

    `health` (the LossHealthMonitor: `unhealthy()` returns why, or None) vetoes every save while the loss is in
    an inf/nan streak (or a spike that will be rewound): such a checkpoint would be the newest, and a resume would
    prefer it to the last good one. The veto is the same on every rank (the loss is reduced before it is judged).
    """

    def __init__(self, manager: CheckpointManager, health: Any = None):
        self.manager = manager
        self.health = health
        self._vetoed: Optional[str] = None

    def _veto(self, step: int) -> bool:
        why = self.health.unhealthy() if self.health is not None and self.manager.save_enabled else None
        if why is None:
            self._vetoed = None
            return False
        if self._vetoed is None and self.manager.rank == 0:
            msg = (f"checkpoint at step {step} not saved: {why}; the newest complete checkpoint stays the last "
                   "good one (saves resume once the loss is healthy)")
            logger.warning(msg)
            if self.manager.alerts is not None:
                self.manager.alerts.send(f"checkpoint at step {step} skipped", msg, level="warning")
        self._vetoed = why
        return True

    def _save(self, trainer: Any, step: int, reason: str, kind: str) -> None:
        if self._veto(step):
            return
        path = self.manager.save(step, reason, kind)
        if path is not None:
            events.emit("saved", step, manager=self.manager)
            trainer.callbacks.fire("on_save", trainer, step, path)

    def on_step_end(self, trainer: Any, metrics: dict) -> None:
        step = int(trainer.state.batch_count)
        req = getattr(trainer, "stop_request", None)
        kind = self.manager.should_save(step)
        if req is not None and req.save:
            req.save = False
            self._save(trainer, step, req.reason or "stop request", "regular")
        elif kind is not None:
            self._save(trainer, step, "checkpoint_every" if kind == "regular" else "oss_snapshot_freq", kind)

    def on_train_end(self, trainer: Any) -> None:
        step = int(trainer.state.batch_count)
        req = getattr(trainer, "stop_request", None)
        stop_save = req is not None and (req.save or req.stop)
        wanted = self.manager.cfg.save_at_end or stop_save
        if wanted and step > 0 and self.manager.last_saved_step != step and self.manager.save_enabled:
            self._save(trainer, step, req.reason if stop_save and req.reason else "end of training", "regular")
        self.manager.close()
