"""The points of a checkpoint's life that outside code may watch: the one seam through which tests inject faults
(tests/helpers/ckpt_faults.py kills a process at a named point) and through which tracing could time the phases.

    events.subscribe(listener)       # listener(phase, step, **info), called in the thread that reaches the point
    events.unsubscribe(listener)

Phases, in the order a save reaches them:
    "shards_written"  every rank: its shards are written and durable, DCP's index (.metadata) is not
    "before_marker"   rank 0: shards, index and meta.json written, the COMPLETE marker not
    "saved"           every rank, in the training thread: the step's save was handed to the manager (info:
                      `manager`, whose `wait()` returns once the checkpoint is complete or failed)

With no listener (every production run) `emit` returns at once. A listener's exception propagates: the save fails
as it would on an I/O error there.
"""

from __future__ import annotations

from typing import Any, Callable

PHASES = ("shards_written", "before_marker", "saved")
Listener = Callable[..., None]
_listeners: list[Listener] = []


def subscribe(listener: Listener) -> None:
    """Call `listener(phase, step, **info)` at every phase of every save of this process."""
    _listeners.append(listener)


def unsubscribe(listener: Listener) -> None:
    if listener in _listeners:
        _listeners.remove(listener)


def emit(phase: str, step: int, **info: Any) -> None:
    if phase not in PHASES:
        raise ValueError(f"unknown checkpoint phase {phase!r}; expected one of {PHASES}")
    for listener in list(_listeners):
        listener(phase, step, **info)
