"""Trainer-level hooks: the familiar shape of HF Trainer's callbacks.

Writers (JSONL, TensorBoard, console), monitors (watchdog, loss health, alerts), the checkpoint manager
and profilers plug into the loop through this list instead of being called from it one by one.
"""

from __future__ import annotations

from typing import Any


class TrainerCallback:
    """Override what you need; every method gets the trainer (its `state`, `cfg`, `run_dir`, ...)."""

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


class CallbackList:
    """Calls every callback in order."""

    def __init__(self, callbacks: list[TrainerCallback] | None = None):
        self.callbacks: list[TrainerCallback] = list(callbacks or [])

    def add(self, cb: TrainerCallback) -> None:
        self.callbacks.append(cb)

    def fire(self, event: str, *args: Any, **kwargs: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, event)(*args, **kwargs)
