"""Automatic rewind on loss spikes: what InternLM's users do by hand (add the bad batches to `skip_batches`, restart
from the last good checkpoint), done by the run itself. `SpikeRewinder` is the rule and the reload; the trainer's
loop calls it after judging the loss health and before saving:

    if rewinder.due(health.spike_streak):           # spiking for `spike_rewind_steps` steps in a row
        outcome = rewinder.rewind(health.spike_streak)   # reloads the checkpoint before the spike
        batch_skipper.add(outcome.skip_batches); health.forget_spikes(); writer.write(..., kind="rewind")

When the loss has spiked (LossHealthMonitor: loss > loss_spike_ratio x its running average) for
`spike_rewind_steps` steps in a row, every rank (the loss is reduced, so all decide alike):

1. rejects the complete checkpoints of the spike's first step or later (none, normally: saves are vetoed while the
   loss spikes, `vetoes_spikes`) and reloads everything from the newest sound checkpoint before the spike;
2. adds the batches of the spiking steps (step s trained batch s - 1) to the BatchSkipper, which is saved in every
   checkpoint, so that a later restart skips them too;
3. writes a `rewind` record into metrics.jsonl (the steps after it are trained again: the last record of a step
   is the one that counts), logs and alerts; and goes on.

At most `max_rewinds` rewinds per run, counted across restarts (the count is saved too); after that, spikes only
alert.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..errors import ConfigError
from ..utils.logging import get_logger
from .manager import CheckpointManager

if TYPE_CHECKING:
    from ..config.schema import MonitorConfig
    from ..monitor.loss_health import LossHealthMonitor

logger = get_logger(__name__)


@dataclass(frozen=True)
class RewindOutcome:
    """What a rewind did: the step it went back to, the batch indices to skip from now on, its metrics record."""

    step: int
    skip_batches: list[int]
    record: dict


class SpikeRewinder:
    """Decides and performs a rewind on a lasting loss spike (see the module docstring).

    Args:
        manager: the run's checkpoint manager (saving on).
        steps: consecutive spiking steps that trigger a rewind (>= 1).
        max_rewinds: rewinds allowed in the run.
    """

    def __init__(self, manager: CheckpointManager, steps: int = 3, max_rewinds: int = 3):
        if steps < 1:
            raise ConfigError(f"monitor.spike_rewind_steps: expected >= 1, got {steps}")
        if max_rewinds < 0:
            raise ConfigError(f"monitor.max_rewinds: expected >= 0, got {max_rewinds}")
        self.manager = manager
        self.steps, self.max_rewinds = int(steps), int(max_rewinds)
        self.rewinds = 0
        self._given_up_at: Optional[int] = None
        # no checkpoint of a spiking state while spikes are rewound: the rewind must find the one before it
        self.vetoes_spikes = True

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

    def due(self, streak: list[int]) -> bool:
        """True when the spike `streak` (its steps) is to be rewound now; False when it is too short, or when no
        rewind is left or possible (said once per streak; saves go on from then: `vetoes_spikes` turns False)."""
        if len(streak) < self.steps:
            return False
        first, last = streak[0], streak[-1]
        if self.rewinds < self.max_rewinds and any(r.step < first for r in self.manager.complete_checkpoints()):
            return True
        if self._given_up_at != first:
            self._given_up_at = first
            why = (f"monitor.max_rewinds ({self.max_rewinds}) reached" if self.rewinds >= self.max_rewinds
                   else f"no complete checkpoint before step {first}")
            self._tell(f"loss spike at step {first}: not rewound",
                       f"loss spike at steps {first}-{last}: not rewinding ({why}); training goes on", "error")
        self.vetoes_spikes = False  # saves go on: the spike is no longer rewound
        return False

    def rewind(self, streak: list[int]) -> RewindOutcome:
        """Reload every registered state from the newest sound checkpoint before the streak's first step."""
        first, last = streak[0], streak[-1]
        t0 = time.perf_counter()
        bad = [s - 1 for s in streak]
        reason = f"loss spike at steps {first}-{last}"
        res = self.manager.rewind(first, reason)
        self.rewinds += 1
        self.vetoes_spikes = True
        elapsed = time.perf_counter() - t0
        self._tell(f"rewound to step {res.step} after a loss spike",
                   f"{reason}: rewound to the checkpoint of step {res.step} ({res.url}) in {elapsed:.1f} s; batches "
                   f"{', '.join(map(str, bad))} are skipped from now on (saved with every checkpoint); rewind "
                   f"{self.rewinds} of at most {self.max_rewinds}", "warning")
        record = {"reason": reason, "from_step": last, "skip_batches": bad, "rewind": self.rewinds, "load_s": elapsed}
        return RewindOutcome(res.step, bad, record)

    def state_dict(self) -> dict:
        return {"rewinds": self.rewinds}

    def load_state_dict(self, sd: dict) -> None:
        """The larger count wins: a rewind reloads an older checkpoint but still counts."""
        self.rewinds = max(self.rewinds, int(sd.get("rewinds", 0)))


def build_spike_rewind(monitor_cfg: MonitorConfig, manager: CheckpointManager,
                       health: Optional[LossHealthMonitor]) -> Optional[SpikeRewinder]:
    """A SpikeRewinder from `cfg.monitor` (spike_rewind, spike_rewind_steps, max_rewinds); None when off. `health`:
    the loss health judge (its `spike_ratio` says what counts as a spike)."""
    if not monitor_cfg.spike_rewind:
        return None
    if health is None or not health.spike_ratio or health.spike_ratio <= 0:
        raise ConfigError("monitor.spike_rewind: needs monitor.loss_spike_ratio > 0 (what counts as a spike)")
    if not manager.save_enabled:
        raise ConfigError("monitor.spike_rewind: needs checkpoints to rewind to (ckpt.enable_save_ckpt=True and "
                          "ckpt.save_ckpt_folder)")
    return SpikeRewinder(manager, int(monitor_cfg.spike_rewind_steps), int(monitor_cfg.max_rewinds))
