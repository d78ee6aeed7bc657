"""SchedulerMetricHook (InternLM's name): times each micro-batch's phases and feeds the training metric."""

from __future__ import annotations

from typing import Any, Optional

from ..callbacks import TrainerCallback
from ..metrics import AccPerplex
from ..utils.timer import Timers


class SchedulerMetricHook(TrainerCallback):
    """Times forward ("fwd"), loss ("cal_loss") and backward ("bwd") and feeds AccPerplex."""

    def __init__(self, timers: Timers, metric: Optional[AccPerplex] = None):
        self.timers = timers
        self.metric = metric

    def on_before_forward(self, trainer: Any) -> None:
        self.timers.start("fwd")

    def on_after_forward(self, trainer: Any) -> None:
        self.timers.stop("fwd")

    def on_before_criterion(self, trainer: Any) -> None:
        self.timers.start("cal_loss")

    def on_after_criterion(self, trainer: Any) -> None:
        self.timers.stop("cal_loss")

    def on_before_backward(self, trainer: Any) -> None:
        self.timers.start("bwd")

    def on_after_backward(self, trainer: Any) -> None:
        self.timers.stop("bwd")

    def on_micro_batch_end(self, trainer, logits, labels, type_ids, token_losses, predictions) -> None:
        if self.metric is not None:
            self.metric.update(logits, labels, type_ids, token_losses, predictions)
