"""Automatic rewind on loss spikes: what InternLM's users do by hand (add the bad batches to `skip_batches`, restart
from the last good checkpoint), done by the run itself.

    rewind = build_spike_rewind(cfg.monitor, manager, loss_health, batch_skipper)   # None unless spike_rewind
    callbacks.add(rewind)                                                          # after the checkpoint callback

When the loss has spiked (LossHealthMonitor: loss > loss_spike_ratio x its running average) for
`spike_rewind_steps` steps in a row, every rank (the loss is reduced, so all decide alike):

1. rejects the complete checkpoints of the spike's first step or later (none, normally: saves are vetoed while the
   loss spikes) and reloads everything from the newest sound checkpoint before the spike;
2. adds the batches of the spiking steps (step s trained batch s - 1) to the BatchSkipper, which is saved in every
   checkpoint, so that a later restart skips them too;
3. writes a `rewind` record into metrics.jsonl (the steps after it are trained again: the last record of a step
   is the one that counts), logs and alerts; and goes on.

At most `max_rewinds` rewinds per run, counted across restarts (the count is saved too); after that, spikes only
alert.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ..callbacks import TrainerCallback
from ..errors import ConfigError
from ..utils.logging import get_logger
from .manager import CheckpointManager

logger = get_logger(__name__)


class SpikeRewind(TrainerCallback):
    """Rewinds the run on a lasting loss spike (see the module docstring).

    Args:
        manager: the run's checkpoint manager (saving on).
        health: the LossHealthMonitor that judges spikes (its `spike_streak`).
        skipper: the BatchSkipper (`add(indices)`).
        steps: consecutive spiking steps that trigger a rewind (>= 1).
        max_rewinds: rewinds allowed in the run.
    """

    def __init__(self, manager: CheckpointManager, health: Any, skipper: Any, steps: int = 3, max_rewinds: int = 3):
        if steps < 1:
            raise ConfigError(f"monitor.spike_rewind_steps: expected >= 1, got {steps}")
        if max_rewinds < 0:
            raise ConfigError(f"monitor.max_rewinds: expected >= 0, got {max_rewinds}")
        self.manager, self.health, self.skipper = manager, health, skipper
        self.steps, self.max_rewinds = int(steps), int(max_rewinds)
        self.rewinds = 0
        self._given_up_at: Optional[int] = None
        health.veto_spikes = True  # no checkpoint of a spiking state: the rewind must find the one before it

    def _tell(self, subject: str, msg: str, level: str) -> None:
        if self.manager.rank != 0:
            return
        (logger.error if level == "error" else logger.warning)(msg)
        alerts = self.manager.alerts
        if alerts is not None:
            try:
                alerts.send(subject, msg, level=level)
            except Exception as e:  # noqa: BLE001 - the rewind goes on without its alert
                logger.error("alerting failed: %s", e)

    def on_step_end(self, trainer: Any, metrics: dict) -> None:
        streak = list(self.health.spike_streak)
        if len(streak) < self.steps:
            return
        first, last = streak[0], streak[-1]
        if self.rewinds >= self.max_rewinds or not any(r.step < first for r in self.manager.complete_checkpoints()):
            if self._given_up_at != first:
                self._given_up_at = first
                why = (f"monitor.max_rewinds ({self.max_rewinds}) reached" if self.rewinds >= self.max_rewinds
                       else f"no complete checkpoint before step {first}")
                self._tell(f"loss spike at step {first}: not rewound",
                           f"loss spike at steps {first}-{last}: not rewinding ({why}); training goes on", "error")
            self.health.veto_spikes = False  # saves go on: the spike is no longer rewound
            return
        t0 = time.perf_counter()
        bad = [s - 1 for s in streak]
        reason = f"loss spike at steps {first}-{last}"
        res = self.manager.rewind(first, reason)
        self.skipper.add(bad)
        self.rewinds += 1
        self.health.spike_streak = []
        self.health.veto_spikes = True
        elapsed = time.perf_counter() - t0
        if getattr(trainer, "writer", None) is not None:
            trainer.writer.write(res.step, {"reason": reason, "from_step": last, "skip_batches": bad,
                                            "rewind": self.rewinds, "load_s": elapsed}, kind="rewind")
        self._tell(f"rewound to step {res.step} after a loss spike",
                   f"{reason}: rewound to the checkpoint of step {res.step} ({res.url}) in {elapsed:.1f} s; batches "
                   f"{', '.join(map(str, bad))} are skipped from now on (saved with every checkpoint); rewind "
                   f"{self.rewinds} of at most {self.max_rewinds}", "warning")

    def state_dict(self) -> dict:
        return {"rewinds": self.rewinds}

    def load_state_dict(self, sd: dict) -> None:
        """The larger count wins: a rewind reloads an older checkpoint but still counts."""
        self.rewinds = max(self.rewinds, int(sd.get("rewinds", 0)))


def build_spike_rewind(monitor_cfg: Any, manager: CheckpointManager, health: Any, skipper: Any
                       ) -> Optional[SpikeRewind]:
    """A SpikeRewind from `cfg.monitor` (spike_rewind, spike_rewind_steps, max_rewinds); None when off."""
    if not monitor_cfg.spike_rewind:
        return None
    if health is None or not health.spike_ratio or health.spike_ratio <= 0:
        raise ConfigError("monitor.spike_rewind: needs monitor.loss_spike_ratio > 0 (what counts as a spike)")
    if not manager.save_enabled:
        raise ConfigError("monitor.spike_rewind: needs checkpoints to rewind to (ckpt.enable_save_ckpt=True and "
                          "ckpt.save_ckpt_folder)")
    return SpikeRewind(manager, health, skipper, int(monitor_cfg.spike_rewind_steps),
                       int(monitor_cfg.max_rewinds))
