"""Staging for async saves: copy the state into one host buffer, allocated once and reused by every later save.

DCP's DefaultStager keys its buffer cache by the Python storage objects of the source tensors; those wrappers come
and go between saves, so in practice every save allocated (and first-touched) a full new copy of model and optimizer
state, which on a VM costs about a second per GB. torch's `_create_cpu_state_dict(pin_memory=True)` allocates each
tensor twice (a pageable one, then its pinned copy from the caching host allocator, which rounds every block up to a
power of two: 1.3-2x the state, ~14-20 GB per rank for 7B on 8 GPUs) and a DTensor three times.

Here a `StagingPlan` lays every tensor of the state (a DTensor's local shard) out in one flat byte buffer, each at
an aligned offset; the stager allocates that buffer once (pageable), pins it in place when the state lives on a GPU
(`cudaHostRegister`: no copy, no rounding), and stages every later save into the same buffer as long as it fits. The
staged state dict holds views of the buffer (DTensors keep their mesh and placements); the non-tensor values are
taken fresh each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

ALIGN = 512  # bytes: every tensor starts on a boundary any dtype (and a vectorized copy) is happy with

Pinner = Callable[[torch.Tensor], Callable[[], None]]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a state dict, in the order `_restage` visits them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


@dataclass(frozen=True)
class StagingPlan:
    """Where each tensor of a state goes in the host buffer: `offsets[i]` (bytes) for the i-th tensor in visiting
    order, `nbytes` the whole buffer; `from_device`: some tensor lives on a GPU (the buffer is then worth pinning)."""

    offsets: tuple[int, ...]
    nbytes: int
    from_device: bool

    @classmethod
    def of(cls, state_dict: dict[str, Any]) -> "StagingPlan":
        offsets, end, from_device = [], 0, False
        for t in _tensors(state_dict):
            local = _local(t)
            offsets.append(end)
            end += _align(local.numel() * local.element_size())
            from_device = from_device or local.device.type == "cuda"
        return cls(tuple(offsets), end, from_device)


def pin_in_place(buffer: torch.Tensor) -> Callable[[], None]:
    """Page-lock `buffer`'s memory where it is (cudaHostRegister) so that device-to-host copies into it run
    asynchronously at full speed; returns the function that unpins it."""
    from torch.cuda import _pin_memory_utils as pin
    ptr = buffer.data_ptr()
    pin.pin_memory(ptr, buffer.numel() * buffer.element_size())
    return lambda: pin.unpin_memory(ptr)


class ReusingCPUStager(AsyncStager):
    """A blocking stager (the loop waits for the copy, nothing more) into one persistent host buffer.

    pin: page-lock the buffer (None: when the state has tensors on a GPU); pinner: how (tests record the call).
    `allocations` counts the buffers allocated so far (one, unless the state grew).
    """

    _synchronize_after_execute = False

    def __init__(self, pin: Optional[bool] = None, pinner: Pinner = pin_in_place):
        self.pin = pin
        self.pinner = pinner
        self.buffer: Optional[torch.Tensor] = None  # uint8, the plan's bytes
        self.pinned = False
        self.allocations = 0
        self._unpin: Optional[Callable[[], None]] = None

    def _reserve(self, plan: StagingPlan) -> torch.Tensor:
        """The buffer, allocated (and pinned) only when there is none yet or the state outgrew it."""
        if self.buffer is None or self.buffer.numel() < plan.nbytes:
            self.close()
            self.buffer = torch.empty(plan.nbytes, dtype=torch.uint8, device="cpu")
            self.allocations += 1
            if self.pin if self.pin is not None else plan.from_device:
                self._unpin = self.pinner(self.buffer)
                self.pinned = True
        return self.buffer

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        plan = StagingPlan.of(state_dict)
        buffer = self._reserve(plan)
        slots = iter(plan.offsets)
        asynchronous: list[torch.device] = []

        def stage_one(t: torch.Tensor) -> torch.Tensor:
            local = _local(t)
            offset = next(slots)
            view = buffer[offset:offset + local.numel() * local.element_size()].view(local.dtype).view(local.shape)
            non_blocking = self.pinned and local.device.type == "cuda"
            view.copy_(local, non_blocking=non_blocking)
            if non_blocking and local.device not in asynchronous:
                asynchronous.append(local.device)
            if isinstance(t, DTensor):  # the same mesh and placements, the shard on the host
                return DTensor(view, t._spec, requires_grad=False)
            return view

        staged = _restage(state_dict, stage_one)
        for device in asynchronous:  # the copies were queued on each device's current stream: done before return
            torch.cuda.current_stream(device).synchronize()
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: `stage` returns after the copy."""

    def close(self) -> None:
        """Unpin and drop the buffer (the next save allocates a new one)."""
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.buffer = None
        self.pinned = False


def _restage(obj: Any, stage_one: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`obj` with every tensor replaced by `stage_one(tensor)`, in `_tensors`' order; other values as they are."""
    if isinstance(obj, torch.Tensor):
        return stage_one(obj)
    if isinstance(obj, dict):
        return {k: _restage(v, stage_one) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_restage(v, stage_one) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_restage(v, stage_one) for v in obj)
    return obj
