"""Loss health: loss-spike alerts and the consecutive inf/nan limit.

    health = build_loss_health(cfg.monitor, alerts, rank)
    verdict = health.judge(metrics)   # the trainer's loop, after each step; raises TrainingError to stop the run

The trainer skips the update of an inf/nan step itself and counts it in `TrainState.inf_nan_skip_batches`;
this judge only reads the metrics record:

* a step is *bad* when `metrics["skipped"]` is true or the loss or `grad_norm` is inf/nan. The first
  bad step of a streak alerts; after `max_consecutive_inf_nan` bad steps in a row it raises
  `TrainingError` naming the steps and the counts (0 disables the limit). The exception monitor alerts
  on that error, so the stop is not alerted twice here.
* a *spike* is a good step whose loss exceeds `loss_spike_ratio` × the exponential moving average of
  the previous good losses (decay `ema_decay`), judged only after `warmup_steps` good steps. One alert
  per spike: consecutive spiking steps are one event. Spiking losses still enter the average, so a
  lasting level shift stops alerting after a while instead of alerting forever.

The loss in the metrics record is the same on every rank (it is reduced before logging), so every rank
raises at the same step; alerts go out from rank 0 only. `state_dict()` carries the average and the
streak across a restart.

`spike_streak` lists the steps of the current run of consecutive spiking steps (what the spike rewind acts on;
`forget_spikes()` after a rewind); `unhealthy(spikes)` says why a checkpoint saved now would be worse than the last
one: an inf/nan streak, or (with `spikes`, while spikes are rewound) a spike streak.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Optional

from internlm_core.errors import TrainingError
from internlm_core.utils.logging import get_logger

from .alert import AlertManager

if TYPE_CHECKING:
    from internlm_core.config.schema import MonitorConfig

logger = get_logger(__name__)


def _as_float(value: Any) -> Optional[float]:
    if value is None:
        return None
    try:
        return float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError):
        return None


def _finite(x: Optional[float]) -> bool:
    return x is None or math.isfinite(x)


class LossHealthMonitor:
    """Judges each step's loss and gradient norm (see the module docstring).

    Args:
        spike_ratio: alert when loss > spike_ratio × running average (0 or less: no spike check).
        max_consecutive_inf_nan: stop after this many bad steps in a row (0: never stop).
        warmup_steps: good steps to average before spikes are judged.
        ema_decay: weight of the old average in the running average (0 < decay < 1).
        alerts: where alerts go (None: log only).
        rank: alerts are sent from rank 0 only.
    """

    def __init__(self, spike_ratio: float = 0.0, max_consecutive_inf_nan: int = 10, warmup_steps: int = 20,
                 ema_decay: float = 0.9, alerts: Optional[AlertManager] = None, rank: int = 0):
        if not 0.0 < ema_decay < 1.0:
            raise ValueError(f"ema_decay: expected 0 < decay < 1, got {ema_decay}")
        if max_consecutive_inf_nan < 0:
            raise ValueError(f"max_consecutive_inf_nan: expected >= 0, got {max_consecutive_inf_nan}")
        self.spike_ratio = float(spike_ratio)
        self.max_consecutive_inf_nan = int(max_consecutive_inf_nan)
        self.warmup_steps = int(warmup_steps)
        self.ema_decay = float(ema_decay)
        self.alerts = alerts
        self.rank = rank
        self.ema: Optional[float] = None
        self.good_steps = 0
        self.consecutive_bad = 0
        self.first_bad_step: Optional[int] = None
        self.total_bad = 0
        self.spikes = 0
        self._in_spike = False
        self.spike_streak: list[int] = []

    def _alert(self, subject: str, content: str, level: str) -> None:
        if self.alerts is not None and self.rank == 0:
            self.alerts.send(subject, content, level=level)

    def check(self, step: int, loss: Any, skipped: bool = False, grad_norm: Any = None,
              inf_nan_skip_batches: Optional[int] = None) -> str:
        """Judge one step; returns "ok", "spike" or "inf_nan"; raises TrainingError at the limit."""
        loss_f, gn_f = _as_float(loss), _as_float(grad_norm)
        if skipped or not _finite(loss_f) or not _finite(gn_f):
            return self._bad(step, loss_f, gn_f, inf_nan_skip_batches)
        if self.consecutive_bad:
            logger.info("step %d: finite loss again after %d inf/nan step(s)", step, self.consecutive_bad)
        self.consecutive_bad = 0
        self.first_bad_step = None
        if loss_f is None:
            return "ok"
        verdict = "ok"
        if self.spike_ratio > 0 and self.ema is not None and self.good_steps >= self.warmup_steps \
                and loss_f > self.spike_ratio * self.ema:
            verdict = "spike"
            self.spikes += 1
            msg = (f"loss spike at step {step}: loss {loss_f:.4f} is {loss_f / self.ema:.2f}x the running average "
                   f"{self.ema:.4f} (monitor.loss_spike_ratio {self.spike_ratio:g})")
            logger.warning(msg)
            if not self._in_spike:
                self._alert(f"loss spike at step {step}", msg, level="warning")
            self._in_spike = True
            self.spike_streak.append(step)
        else:
            self._in_spike = False
            self.spike_streak = []
        self.ema = loss_f if self.ema is None else self.ema_decay * self.ema + (1 - self.ema_decay) * loss_f
        self.good_steps += 1
        return verdict

    def _bad(self, step: int, loss: Optional[float], grad_norm: Optional[float],
             inf_nan_skip_batches: Optional[int]) -> str:
        self.consecutive_bad += 1
        self.total_bad += 1
        if self.first_bad_step is None:
            self.first_bad_step = step
        skipped_total = inf_nan_skip_batches if inf_nan_skip_batches is not None else self.total_bad
        what = f"loss {loss}, grad_norm {grad_norm}"
        limit = self.max_consecutive_inf_nan
        logger.warning("step %d: inf/nan (%s); update skipped; %d in a row%s, %d skipped in total",
                       step, what, self.consecutive_bad, f" (limit {limit})" if limit else "", skipped_total)
        if self.consecutive_bad == 1:
            self._alert(f"inf/nan at step {step}",
                        f"step {step}: {what}; the update was skipped ({skipped_total} skipped in total)",
                        level="warning")
        if limit and self.consecutive_bad >= limit:
            raise TrainingError(
                f"loss or gradient was inf/nan for {self.consecutive_bad} consecutive steps "
                f"(steps {self.first_bad_step}-{step}; monitor.max_consecutive_inf_nan={limit}); "
                f"last {what}; {skipped_total} updates skipped in total. Stopping instead of training on "
                f"garbage: lower the learning rate, check the data, or resume from an earlier checkpoint.")
        return "inf_nan"

    def unhealthy(self, spikes: bool = False) -> Optional[str]:
        """Why the state now is worse than at the last good step (None: healthy); a spike streak counts with
        `spikes` (the loop passes it while spikes are rewound: the rewind must find the checkpoint before them)."""
        if self.consecutive_bad:
            return (f"loss or gradient inf/nan for {self.consecutive_bad} step(s) in a row since step "
                    f"{self.first_bad_step}")
        if spikes and self.spike_streak:
            return f"loss spike since step {self.spike_streak[0]} ({len(self.spike_streak)} step(s))"
        return None

    def forget_spikes(self) -> None:
        """A rewind went back before the streak: its steps are no longer the run's."""
        self.spike_streak = []

    def judge(self, metrics: Mapping[str, Any]) -> str:
        """`check` on a step's metrics record ("ok", "spike" or "inf_nan"; TrainingError at the limit)."""
        return self.check(int(metrics["step"]), metrics.get("loss"), skipped=bool(metrics.get("skipped", False)),
                          grad_norm=metrics.get("grad_norm"), inf_nan_skip_batches=metrics.get("inf_nan_skip_batches"))

    def state_dict(self) -> dict:
        """Plain numbers only (nan / -1 stand for "none yet"), so any checkpoint format can hold it."""
        return {"ema": float("nan") if self.ema is None else self.ema, "good_steps": self.good_steps,
                "consecutive_bad": self.consecutive_bad,
                "first_bad_step": -1 if self.first_bad_step is None else self.first_bad_step,
                "total_bad": self.total_bad, "spikes": self.spikes}

    def load_state_dict(self, sd: dict) -> None:
        ema = float(sd.get("ema", float("nan")))
        self.ema = None if math.isnan(ema) else ema
        self.good_steps = int(sd.get("good_steps", 0))
        self.consecutive_bad = int(sd.get("consecutive_bad", 0))
        first = int(sd.get("first_bad_step", -1))
        self.first_bad_step = None if first < 0 else first
        self.total_bad = int(sd.get("total_bad", 0))
        self.spikes = int(sd.get("spikes", 0))


INTERNLM_LOSS_SPIKE_RATIO = 1.5  # InternLM's loss_spike_limit with alerts on


def build_loss_health(monitor_cfg: MonitorConfig, alerts: Optional[AlertManager] = None, rank: int = 0,
                      **kwargs: Any) -> LossHealthMonitor:
    """A LossHealthMonitor from `cfg.monitor` (loss_spike_ratio, max_consecutive_inf_nan); an unset (None)
    loss_spike_ratio is InternLM's 1.5 when alerts go somewhere, else off."""
    ratio = monitor_cfg.loss_spike_ratio
    if ratio is None:
        ratio = INTERNLM_LOSS_SPIKE_RATIO if alerts is not None and alerts.enabled else 0.0
    return LossHealthMonitor(spike_ratio=ratio,
                             max_consecutive_inf_nan=monitor_cfg.max_consecutive_inf_nan,
                             alerts=alerts, rank=rank, **kwargs)
