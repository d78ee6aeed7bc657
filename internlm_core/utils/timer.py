"""The one timer: named wall-clock timers that accumulate within a step (synchronizing CUDA when asked)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


class Timers:
    """`with timers("fwd"): ...` accumulates seconds under "fwd" until `pop()` returns and resets them."""

    def __init__(self, cuda_sync: bool = False):
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self._acc: dict[str, float] = {}
        self._start: dict[str, float] = {}

    def _now(self) -> float:
        if self.cuda_sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def start(self, name: str) -> None:
        self._start[name] = self._now()

    def stop(self, name: str) -> None:
        t0 = self._start.pop(name, None)
        if t0 is not None:
            self._acc[name] = self._acc.get(name, 0.0) + self._now() - t0

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def pop(self) -> dict[str, float]:
        out, self._acc = self._acc, {}
        return out
