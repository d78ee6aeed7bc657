"""The observers of the training loop: step events (HF Trainer's shape) and micro-batch events (InternLM's
scheduler hooks), each given a typed, read-only `StepView` of the run.

Callbacks observe (metrics, plots, trackers, profiling, heartbeats); they decide nothing and change no trainer state:
saving, stopping, rewinding and validating are decided by the loop itself (`trainer.trainer.Trainer.train`, through
its named parts: the stop poller, the loss health judge, the spike rewinder, the checkpointer). The order of the
callbacks in the list is the order they are told, nothing depends on it. A callback that wants a checkpoint of
this step, or the run to stop after it, asks through `view.requests` (`ask_save(reason)`, `ask_stop(reason)`): the
loop reads the requests when it polls stop requests, right after `on_step_end`, so a save asked for at step s is a
save of step s. A save is collective: every rank must ask at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Optional

import torch


@dataclass(frozen=True)
class Progress:
    """A snapshot of the run's progress (trainer.state.TrainState's counters) when the event fired."""

    batch_count: int = 0       # batches consumed, skipped ones included: the `step` of metrics and checkpoints
    step_count: int = 0        # successful optimizer updates
    num_consumed_tokens: int = 0
    num_consumed_samples_in_epoch: int = 0
    inf_nan_skip_batches: int = 0


@dataclass
class StepRequests:
    """What callbacks ask of the loop for the current step (the one channel from an observer to the loop): the loop
    honours them when it polls stop requests after `on_step_end`, then clears them."""

    save: bool = False
    stop: bool = False
    reason: str = ""

    def ask_save(self, reason: str) -> None:
        """A checkpoint of this step (every rank must ask: a save is collective)."""
        self.save, self.reason = True, self.reason or reason

    def ask_stop(self, reason: str) -> None:
        """Save (as a stop request does) and stop after this step (every rank must ask)."""
        self.save = self.stop = True
        self.reason = self.reason or reason

    def take(self) -> tuple[bool, bool, str]:
        """(save, stop, reason) asked so far; clears them."""
        out = (self.save, self.stop, self.reason)
        self.save = self.stop = False
        self.reason = ""
        return out


@dataclass(frozen=True)
class StepView:
    """What a callback sees of the run at an event; frozen (assigning a field raises FrozenInstanceError) and
    `metrics` is a read-only mapping. `model` and `optimizer` are there to be read (digests, memory, plots); a
    callback that steps, loads or assigns them breaks the contract (`requests` is the one way to ask for a save or
    a stop)."""

    step: int                      # trainer.state.batch_count when the event fired
    progress: Progress
    run_dir: Path
    rank: int
    world_size: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    requests: StepRequests
    metrics: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    resumed_from: Optional[str] = None  # the checkpoint the run resumed from (None: a fresh start)

    @property
    def state(self) -> Progress:
        """The progress snapshot under the trainer's name for it (`view.state.batch_count`)."""
        return self.progress


class TrainerCallback:
    """Override what you need; the defaults do nothing. Every method gets the `StepView` first."""

    # ---- steps ----------------------------------------------------------------------------------------
    def on_train_start(self, view: StepView) -> None:
        """After everything is built and any checkpoint is loaded, before the first batch."""

    def on_step_end(self, view: StepView, metrics: Mapping[str, Any]) -> None:
        """After each optimizer step (or skipped update) and the loss health's verdict, before the loop's decisions
        (stop, rewind, save, validation); `metrics` (= `view.metrics`) is that step's record."""

    def on_validation_end(self, view: StepView, metrics: Mapping[str, Any]) -> None:
        """After a validation pass; `metrics` holds `valid/...` keys."""

    def on_save(self, view: StepView, step: int, path: str) -> None:
        """After a checkpoint of `step` was handed to the checkpoint manager."""

    def on_train_end(self, view: StepView) -> None:
        """After the last step (also after a stop) and the final save, before the process group is torn down."""

    # ---- micro-batches (InternLM's SchedulerHook) --------------------------------------------------------
    def on_before_forward(self, view: StepView) -> None:
        """Before the forward of a micro-batch."""

    def on_after_forward(self, view: StepView) -> None:
        """After the forward of a micro-batch."""

    def on_before_criterion(self, view: StepView) -> None:
        """Before the loss of a micro-batch."""

    def on_after_criterion(self, view: StepView) -> None:
        """After the loss of a micro-batch."""

    def on_before_backward(self, view: StepView) -> None:
        """Before the backward of a micro-batch."""

    def on_after_backward(self, view: StepView) -> None:
        """After the backward of a micro-batch."""

    def on_micro_batch_end(self, view: StepView, logits: torch.Tensor, labels: torch.Tensor,
                           type_ids: Optional[torch.Tensor], token_losses: Optional[torch.Tensor],
                           predictions: Optional[torch.Tensor]) -> None:
        """After the loss of a training micro-batch (InternLM's post_helper_func): its detached logits,
        labels, dataset types, per-token losses and argmax (each None when the loss did not compute it)."""


class CallbackList:
    """Tells every callback, in list order (nothing depends on the order)."""

    def __init__(self, callbacks: list[TrainerCallback] | None = None):
        self.callbacks: list[TrainerCallback] = list(callbacks or [])

    def add(self, cb: TrainerCallback) -> None:
        self.callbacks.append(cb)

    def fire(self, event: str, *args: Any, **kwargs: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(*args, **kwargs)
