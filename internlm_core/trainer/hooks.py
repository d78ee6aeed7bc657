"""SchedulerMetricHook (InternLM's name): the loop's own per-micro-batch instrument, phase timers and the training
metric. The loop calls it directly: training acc/ppl and the fwd/cal_loss/bwd times never depend on which
callbacks a run has (callbacks observe the same events through `CallbackList`)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from ..metrics import AccPerplex
from ..utils.timer import Timers


class SchedulerMetricHook:
    """Times forward ("fwd"), loss ("cal_loss"), backward ("bwd") and a pipeline step ("fwd_bwd") in `timers`,
    and feeds each training micro-batch's outputs to `metric` (AccPerplex: the step's acc/ppl per type)."""

    PHASES = ("fwd", "cal_loss", "bwd", "fwd_bwd")

    def __init__(self, timers: Timers, metric: AccPerplex):
        self.timers = timers
        self.metric = metric

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time one phase of a micro-batch (or of a whole pipeline step)."""
        if name not in self.PHASES:
            raise ValueError(f"unknown phase {name!r}; expected one of {self.PHASES}")
        with self.timers(name):
            yield

    def record(self, logits: torch.Tensor, labels: torch.Tensor, type_ids: Optional[torch.Tensor],
               token_losses: Optional[torch.Tensor], predictions: Optional[torch.Tensor]) -> None:
        """One training micro-batch's outputs into the step's metric."""
        self.metric.update(logits, labels, type_ids, token_losses, predictions)

    def step_metrics(self, tokens_per_type: dict, sums: Optional[torch.Tensor] = None) -> dict:
        """The step's record from the instruments: training acc/ppl (per type), `tokens/<type>` (all ranks' tokens
        of each type so far, as given) and the phase times `time/<phase>` (the timers are reset); `sums`: the
        metric's reduced sums already read on the host (the step's one read, trainer/readout.py)."""
        m = self.metric.get_metric(sums=sums)
        out = {k: v for k, v in m.items() if k in ("acc", "ppl") or k.startswith("acc/")}
        out.update({f"tokens/{k}": v for k, v in tokens_per_type.items()})
        out.update({f"time/{k}": v for k, v in self.timers.pop().items()})
        return out
