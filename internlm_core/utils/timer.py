"""The one timer: named timers that accumulate within a step; on a CUDA device they measure device time."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional, Union

import torch

_Start = Union[float, "torch.cuda.Event"]


class Timers:
    """`with timers("fwd"): ...` accumulates seconds under "fwd" until `pop()` returns and resets them.

    With a CUDA `device`, an interval runs between two CUDA events: the time the device took from reaching the
    start to reaching the end, without making the host wait (a host clock would only measure how fast the
    kernels were enqueued, so a slow GPU would not show in the straggler check); `pop()` waits for the events.
    Names in `host` ("data": batches are loaded on the host) and every name on other devices use the host
    clock. `cuda_sync=True` instead synchronizes the device at each start and stop (host clock).
    """

    def __init__(self, cuda_sync: bool = False, device: Optional[torch.device | str] = None,
                 host: Iterable[str] = ("data",)):
        self.cuda_sync = cuda_sync and torch.cuda.is_available()
        self.events = not self.cuda_sync and device is not None and torch.device(device).type == "cuda"
        self.host = frozenset(host)
        self._acc: dict[str, float] = {}
        self._start: dict[str, _Start] = {}
        self._pending: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    def _now(self) -> float:
        if self.cuda_sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _mark(self, name: str) -> _Start:
        if self.events and name not in self.host:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._now()

    def start(self, name: str) -> None:
        self._start[name] = self._mark(name)

    def stop(self, name: str) -> None:
        t0 = self._start.pop(name, None)
        if t0 is None:
            return
        t1 = self._mark(name)
        if isinstance(t0, float):
            self._acc[name] = self._acc.get(name, 0.0) + t1 - t0
        else:
            self._pending.setdefault(name, []).append((t0, t1))

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)

    def pop(self) -> dict[str, float]:
        """Seconds per name since the last pop (device intervals read once their events completed)."""
        for name, pairs in self._pending.items():
            pairs[-1][1].synchronize()
            self._acc[name] = self._acc.get(name, 0.0) + sum(a.elapsed_time(b) for a, b in pairs) / 1000.0
        self._pending = {}
        out, self._acc = self._acc, {}
        return out
