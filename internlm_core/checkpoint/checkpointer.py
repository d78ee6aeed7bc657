"""The loop's save rule: when a step is saved (`due`), the save itself with its health veto (`save`), and the final
save at the end of training (`final`). The trainer's loop calls them, in its order; nothing here reads the trainer.

    decision = checkpointer.due(step, requested=stop.save, reason=stop.reason)   # None: no save at this step
    if decision is not None:
        path = checkpointer.save(step, decision, unhealthy=why)                   # None: vetoed or saving off
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..utils.logging import get_logger
from . import events
from .manager import CheckpointManager

logger = get_logger(__name__)


@dataclass(frozen=True)
class SaveDecision:
    """A save the loop takes at this step: why, and which kind ("regular": named by the step; "snapshot": one of
    the rotating oss_snapshot slots)."""

    reason: str
    kind: str = "regular"


class Checkpointer:
    """Saves after a step when `checkpoint_every` / `oss_snapshot_freq` say so or a stop request (stop file, signal,
    a callback's `view.requests`) asks for one, and at the end of training (`save_at_end`, or after a stop) unless
    that step is saved already; `close` waits for the background write/upload and raises CheckpointError if the
    last checkpoint did not complete.

    A save is vetoed while the loss is unhealthy (`unhealthy`: why, from the loss health judge; the loop passes
    it): such a checkpoint would be the newest, and a resume would prefer it to the last good one. The veto is the
    same on every rank (the loss is reduced before it is judged)."""

    def __init__(self, manager: CheckpointManager):
        self.manager = manager
        self._vetoed: Optional[str] = None

    def due(self, step: int, requested: bool = False, reason: str = "") -> Optional[SaveDecision]:
        """The save of `step`, if any: a requested one first, else the periodic one."""
        if requested:
            return SaveDecision(reason or "stop request", "regular")
        kind = self.manager.should_save(step)
        if kind is None:
            return None
        return SaveDecision("checkpoint_every" if kind == "regular" else "oss_snapshot_freq", kind)

    def final(self, step: int, stopped: bool, reason: str = "") -> Optional[SaveDecision]:
        """The save at the end of training: `ckpt.save_at_end`, or after a stop; not when `step` is saved already."""
        m = self.manager
        if not (m.cfg.save_at_end or stopped) or step <= 0 or m.last_saved_step == step or not m.save_enabled:
            return None
        return SaveDecision(reason if stopped and reason else "end of training", "regular")

    def save(self, step: int, decision: SaveDecision, unhealthy: Optional[str] = None) -> Optional[str]:
        """Save `step` unless vetoed; the checkpoint's URL (None: vetoed, or saving is off)."""
        if self._veto(step, unhealthy):
            return None
        path = self.manager.save(step, decision.reason, decision.kind)
        if path is not None:
            events.emit("saved", step, manager=self.manager)
        return path

    def close(self) -> None:
        """Wait for the last save (CheckpointError if it did not complete) and give the folder's lease back."""
        self.manager.close()

    def _veto(self, step: int, unhealthy: Optional[str]) -> bool:
        why = unhealthy if self.manager.save_enabled else None
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
