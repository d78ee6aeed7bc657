"""The one callback system of the training loop: step events (HF Trainer's shape) and micro-batch events
(InternLM's scheduler hooks).

Monitors (watchdog, loss health, stragglers, alerts), the checkpoint callback, profilers and a driver's own
callbacks plug into the loop through one `CallbackList` (in the order `trainer.build.CALLBACK_ORDER` declares)
instead of being called from it one by one. Callbacks observe and steer (a stop request, a save); they never carry
a result the loop needs: the loop times its phases and feeds its training metric itself
(`trainer.hooks.SchedulerMetricHook`). Every method gets the trainer first (its `state`, `run_dir`, ...).
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class TrainerCallback:
    """Override what you need; the defaults do nothing."""

    # ---- steps ----------------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any) -> None:
        """After everything is built and any checkpoint is loaded, before the first batch."""

    def on_step_end(self, trainer: Any, metrics: dict) -> None:
        """After each optimizer step (or skipped update); `metrics` is that step's record."""

    def on_validation_end(self, trainer: Any, metrics: dict) -> None:
        """After a validation pass; `metrics` holds `valid/...` keys."""

    def on_save(self, trainer: Any, step: int, path: str) -> None:
        """After a checkpoint of `step` was handed to the checkpoint manager."""

    def on_train_end(self, trainer: Any) -> None:
        """After the last step (also after a stop request), before the process group is torn down."""

    # ---- micro-batches (InternLM's SchedulerHook) --------------------------------------------------------
    def on_before_forward(self, trainer: Any) -> None:
        """Before the forward of a micro-batch."""

    def on_after_forward(self, trainer: Any) -> None:
        """After the forward of a micro-batch."""

    def on_before_criterion(self, trainer: Any) -> None:
        """Before the loss of a micro-batch."""

    def on_after_criterion(self, trainer: Any) -> None:
        """After the loss of a micro-batch."""

    def on_before_backward(self, trainer: Any) -> None:
        """Before the backward of a micro-batch."""

    def on_after_backward(self, trainer: Any) -> None:
        """After the backward of a micro-batch."""

    def on_micro_batch_end(self, trainer: Any, logits: torch.Tensor, labels: torch.Tensor,
                           type_ids: Optional[torch.Tensor], token_losses: Optional[torch.Tensor],
                           predictions: Optional[torch.Tensor]) -> None:
        """After the loss of a training micro-batch (InternLM's post_helper_func): its detached logits,
        labels, dataset types, per-token losses and argmax (each None when the loss did not compute it)."""


class CallbackList:
    """Calls every callback in order."""

    def __init__(self, callbacks: list[TrainerCallback] | None = None):
        self.callbacks: list[TrainerCallback] = list(callbacks or [])

    def add(self, cb: TrainerCallback) -> None:
        self.callbacks.append(cb)

    def fire(self, event: str, *args: Any, **kwargs: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(*args, **kwargs)
