"""The checkpoint manager as a trainer callback: periodic saves, stop requests, the final save, waiting at the end."""

from __future__ import annotations

from typing import Any

from ..callbacks import TrainerCallback
from . import faults
from .manager import CheckpointManager


class CheckpointCallback(TrainerCallback):
    """Saves after a step when `checkpoint_every` / `oss_snapshot_freq` say so or `trainer.stop_request.save`
    is set (by the StopController, which must come before this callback in the list), and at the end of
    training (`save_at_end`, or a stop request whose save was not taken yet); then waits for the background
    write/upload and raises CheckpointError if the last checkpoint did not complete."""

    def __init__(self, manager: CheckpointManager):
        self.manager = manager

    def _save(self, trainer: Any, step: int, reason: str, kind: str) -> None:
        path = self.manager.save(step, reason, kind)
        if path is not None:
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
        if faults.requested("kill_after_commit", step):  # test-only: die once this step's checkpoint is complete
            self.manager.wait()
            faults.maybe_kill("kill_after_commit", step)

    def on_train_end(self, trainer: Any) -> None:
        step = int(trainer.state.batch_count)
        req = getattr(trainer, "stop_request", None)
        stop_save = req is not None and (req.save or req.stop)
        wanted = self.manager.cfg.save_at_end or stop_save
        if wanted and step > 0 and self.manager.last_saved_step != step and self.manager.save_enabled:
            self._save(trainer, step, req.reason if stop_save and req.reason else "end of training", "regular")
        self.manager.close()
