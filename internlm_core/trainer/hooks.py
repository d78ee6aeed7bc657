"""Scheduler hooks around each micro-batch (InternLM's SchedulerHook / SchedulerMetricHook)."""

from __future__ import annotations

from typing import Optional

import torch

from ..metrics import AccPerplex
from ..utils.timer import Timers


class SchedulerHook:
    """Called around forward, loss and backward of every micro-batch."""

    def before_forward(self) -> None: ...
    def after_forward(self) -> None: ...
    def before_criterion(self) -> None: ...
    def after_criterion(self) -> None: ...
    def before_backward(self) -> None: ...
    def after_backward(self) -> None: ...

    def post_helper_func(self, logits: torch.Tensor, labels: torch.Tensor, type_ids: Optional[torch.Tensor],
                         token_losses: Optional[torch.Tensor], predictions: Optional[torch.Tensor] = None) -> None:
        """After the loss of a micro-batch: outputs for metrics (`predictions`: the logits' argmax, when the
        loss computed it)."""


class SchedulerMetricHook(SchedulerHook):
    """Times forward ("fwd"), loss ("cal_loss") and backward ("bwd") and feeds AccPerplex."""

    def __init__(self, timers: Timers, metric: Optional[AccPerplex] = None):
        self.timers = timers
        self.metric = metric

    def before_forward(self) -> None:
        self.timers.start("fwd")

    def after_forward(self) -> None:
        self.timers.stop("fwd")

    def before_criterion(self) -> None:
        self.timers.start("cal_loss")

    def after_criterion(self) -> None:
        self.timers.stop("cal_loss")

    def before_backward(self) -> None:
        self.timers.start("bwd")

    def after_backward(self) -> None:
        self.timers.stop("bwd")

    def post_helper_func(self, logits, labels, type_ids, token_losses, predictions=None) -> None:
        if self.metric is not None:
            self.metric.update(logits, labels, type_ids, token_losses, predictions)


class HookList:
    """Fans each call out to every hook."""

    def __init__(self, hooks: list[SchedulerHook]):
        self.hooks = hooks

    def __getattr__(self, name: str):
        def call(*args, **kwargs):
            for h in self.hooks:
                getattr(h, name)(*args, **kwargs)
        return call
