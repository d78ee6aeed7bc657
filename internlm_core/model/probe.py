"""Forwards that belong to no training step: torch's pipeline metadata inference runs each stage once on made-up
inputs (empty tensors of the exchanged shapes) to learn what the stages send each other. A layer that keeps
statistics of its forwards (the MoE layers' routing loads and losses, the expert-bias loads) skips them while
`probing()` says so; the pipeline (parallel/pipeline.py) wraps torch's inference in `probe_forward()`."""

from __future__ import annotations

import contextlib
from typing import Iterator

_DEPTH = {"value": 0}


@contextlib.contextmanager
def probe_forward() -> Iterator[None]:
    """Forwards inside this context are probes: no statistics are recorded from them."""
    _DEPTH["value"] += 1
    try:
        yield
    finally:
        _DEPTH["value"] -= 1


def probing() -> bool:
    """Whether the current forward is a probe (inside `probe_forward`)."""
    return _DEPTH["value"] > 0
