"""Activation offload to host memory (`model.offload_activations`).

Each transformer block's forward runs under `torch.autograd.graph.saved_tensors_hooks`: what autograd saves for the
block's backward is copied to host memory in the forward and copied back when the backward unpacks it. Under
activation checkpointing the hooks sit outside the checkpoint, so what they see is what the checkpoint saves, the
block's inputs (the recompute's own tensors live only during that block's backward); under `selective` the outputs
the policy keeps are held by the checkpoint's cache, not saved tensors, and stay on the device.

Kept on the device (counted in `OffloadStats.kept_*`): tensors smaller than MIN_BYTES (16 KiB: below it a copy's
launch costs more than the memory it frees: masks, cu_seqlens, norms' statistics of short rows), parameters and views
of them (nn.Parameter or a view whose `_base` is one: the weights a matmul saves are there anyway), and tensor
subclasses other than DTensor (a low-precision weight wrapper's). A DTensor (tensor parallel's matmuls save them)
moves its local tensor and is rebuilt around the copy in backward (same mesh, placements, shape and strides), so
tensor parallel composes with the offload. A tensor one block's forward
saves several times (the normed input of separate q, k, v projections), or saves as several views of one run
of memory (the attention probabilities and their batched matmul's reshape), is copied once; one saved by several blocks
(the rotary tables) is copied by each.

The copies, on CUDA (`CudaOps`): pack records an event on the compute stream, the side stream waits for it and
copies the tensor into a pinned host buffer with non_blocking=True, and `record_stream(side)` keeps the device
memory from being reused before that copy has read it; an event marks the copy done. A block's forward starts (on
the compute stream) only after the copies out of the block IN_FLIGHT (2) before it are done: copies slower than the
compute would otherwise hold the device memory of the whole forward. In backward, the first unpack of a block copies
all its tensors back on the side stream (after their device-to-host events) and then prefetches the block forwarded
before it (the next one backward reaches) the same way; each unpack makes the compute stream wait for its tensor's
host-to-device event and `record_stream(compute)` the device copy (allocated on the side stream).
The decisions are plain methods over an `ops` object (`CudaOps`, `HostOps`), so the order is tested on the CPU with
a recorder. On the CPU (`HostOps`, device == host) the copies are synchronous into separate plain buffers: the hooks
and the bookkeeping run, nothing is saved.
Composes with pipeline parallel (each stage's blocks; tests/e2e/test_offload_e2e.py: 2 stages' losses equal) and
with `model.compile` (the copies keep each tensor's strides, which compiled backward graphs assert: gradients
bitwise equal on the CPU, checked by hand, not in the unit tests: ~1 min of compilation).
A saved tensor must not be modified in place after it is saved (autograd refuses that without hooks; with them the
copy may read it late): the model families here never do.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

__all__ = ["MIN_BYTES", "CudaOps", "HostOps", "Offloader", "OffloadStats", "check_offload", "offload_blocks"]

MIN_BYTES = 16 * 1024  # saved tensors smaller than this stay on the device
IN_FLIGHT = 2  # a block's forward starts after the copies out of the block IN_FLIGHT before it are done


def is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (a weight's transpose that a matmul saves)."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def _geometry(t: torch.Tensor) -> tuple:
    """The run of memory t's elements lie in: two live tensors with the same one (views of each other, a softmax's
    output and the batched matmul's reshape of it) are served by one copy of that run."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), _span(t), t.dtype)


def _span(t: torch.Tensor) -> int:
    """Elements of t's storage from its offset to its last element (a view's strides are kept, gaps and all)."""
    return 1 + sum((size - 1) * stride for size, stride in zip(t.size(), t.stride()))


def _copy_layout(t: torch.Tensor, device: Any, pin: bool = False, non_blocking: bool = False) -> torch.Tensor:
    """A copy of t on `device` with t's size and strides (compiled backward graphs assert them): the span of t's
    storage it covers is copied, as one flat run."""
    n = _span(t)
    flat = torch.empty(n, dtype=t.dtype, device=device, pin_memory=pin)
    flat.copy_(t.detach().as_strided((n,), (1,), t.storage_offset()), non_blocking=non_blocking)
    return flat.as_strided(t.size(), t.stride(), 0)


class HostOps:
    """Device == host (CPU): synchronous copies into separate plain buffers; no streams, no events."""

    def current_stream(self) -> Any:
        return None

    def side_stream(self) -> Any:
        return None

    def record_event(self, stream: Any) -> Any:
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        pass

    def to_host(self, t: torch.Tensor, stream: Any) -> torch.Tensor:
        return _copy_layout(t, "cpu")

    def to_device(self, host: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        return _copy_layout(host, device)


class CudaOps(HostOps):
    """CUDA: the copies on one side stream, non_blocking, into and out of pinned host buffers."""

    def __init__(self, device: torch.device):
        self.device = device
        self._side = torch.cuda.Stream(device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def side_stream(self) -> Any:
        return self._side

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def to_host(self, t: torch.Tensor, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return _copy_layout(t, "cpu", pin=True, non_blocking=True)

    def to_device(self, host: torch.Tensor, device: torch.device, stream: Any) -> torch.Tensor:
        with torch.cuda.stream(stream):
            return _copy_layout(host, device, non_blocking=True)


@dataclass
class OffloadStats:
    """What the hooks did since the last `reset`: tensors and bytes moved to the host and kept on the device."""

    packs: int = 0
    unpacks: int = 0
    offloaded: int = 0
    offloaded_bytes: int = 0
    kept_small_bytes: int = 0
    kept_param_bytes: int = 0
    kept_subclass_bytes: int = 0
    deduplicated: int = 0        # saves of a tensor the same block had already offloaded (one copy serves)
    deduplicated_bytes: int = 0
    fetched_groups: int = 0
    prefetched_groups: int = 0


class _Saved:
    """The packed form of one offloaded tensor: its host copy, then its device copy once fetched."""

    __slots__ = ("group", "host", "d2h_done", "device", "dev", "h2d_done", "__weakref__")

    def __init__(self, group: "_Group", host: torch.Tensor, d2h_done: Any, device: torch.device):
        self.group, self.host, self.d2h_done, self.device = group, host, d2h_done, device
        self.dev: Optional[torch.Tensor] = None
        self.h2d_done: Any = None


class _View:
    """Another view (its size and strides) of the run of memory an offloaded tensor's copy holds."""

    __slots__ = ("base", "size", "stride")

    def __init__(self, base: _Saved, size: torch.Size, stride: tuple):
        self.base, self.size, self.stride = base, size, stride


class _Distributed:
    """An offloaded DTensor: its local tensor's packed form and what rebuilds the DTensor around its copy back."""

    __slots__ = ("local", "mesh", "placements", "shape", "stride")

    def __init__(self, local: Any, mesh: Any, placements: tuple, shape: torch.Size, stride: tuple):
        self.local, self.mesh, self.placements, self.shape, self.stride = local, mesh, placements, shape, stride


@dataclass(eq=False)
class _Group:
    """One forward of one block. Only the autograd graph holds _Saved (and through them their group) strongly: the
    links here are weak, so a step's buffers go with its graph."""

    index: int
    prev: Optional[weakref.ref] = None
    saved: list = field(default_factory=list)  # weakref.ref(_Saved)
    fetched: bool = False   # its copies back started
    started: bool = False   # backward unpacked one of its tensors
    last_d2h: Any = None    # the event of its last copy out
    seen: dict = field(default_factory=dict)  # during its forward: run of memory -> (weakref t, version, _Saved,
    #                                            t's size and strides)

    def __hash__(self) -> int:
        return id(self)


class Offloader:
    """The pack/unpack hooks of every offloaded block of one model and the order of their copies (module doc)."""

    def __init__(self, ops: Any, min_bytes: int = MIN_BYTES, in_flight: int = IN_FLIGHT):
        self.ops, self.min_bytes, self.in_flight = ops, min_bytes, in_flight
        self.stats = OffloadStats()
        self._copies_out: collections.deque = collections.deque()  # each recent block's last copy-out event
        self._current: Optional[_Group] = None
        self._last: Optional[weakref.ref] = None

    def reset(self) -> None:
        self.stats = OffloadStats()

    @contextlib.contextmanager
    def block(self, index: int) -> Iterator[None]:
        """The forward of block `index` (its position in the model): its saved tensors are offloaded."""
        last = self._last() if self._last is not None else None
        # the block forwarded just before, in the same pass (a lower index): the one backward reaches next
        group = _Group(index, weakref.ref(last) if last is not None and last.index < index else None)
        outer, self._current, self._last = self._current, group, weakref.ref(group)
        while len(self._copies_out) >= self.in_flight:  # bound the device memory the copies out still hold
            self.ops.wait_event(self.ops.current_stream(), self._copies_out.popleft())
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                yield
        finally:
            self._current = outer
            group.seen.clear()
            if group.last_d2h is not None:
                self._copies_out.append(group.last_d2h)

    def _keep(self, t: torch.Tensor) -> bool:
        local = t._local_tensor if type(t) is DTensor else t
        nbytes = local.numel() * local.element_size()
        if is_parameter(t):
            self.stats.kept_param_bytes += nbytes
        elif type(local) is not torch.Tensor:
            self.stats.kept_subclass_bytes += nbytes
        elif nbytes < self.min_bytes:
            self.stats.kept_small_bytes += nbytes
        else:
            return False
        return True

    def pack(self, t: torch.Tensor) -> Any:
        """Forward: start t's copy to the host after what wrote it; a kept tensor is returned as is. A DTensor
        (tensor parallel's matmuls save them) moves its local tensor and is rebuilt around it in backward."""
        self.stats.packs += 1
        if self._keep(t) or self._current is None:
            return t
        if type(t) is DTensor:
            return _Distributed(self._pack(t._local_tensor), t.device_mesh, t.placements, t.shape, t.stride())
        return self._pack(t)

    def _pack(self, t: torch.Tensor) -> Any:
        again = self._again(t)
        if again is not None:
            return again
        ops = self.ops
        side = ops.side_stream()
        ops.wait_event(side, ops.record_event(ops.current_stream()))  # the copy starts after t is written
        host = ops.to_host(t, side)
        ops.record_stream(t, side)  # t's memory is not reused before the copy has read it
        saved = _Saved(self._current, host, ops.record_event(side), t.device)
        self._current.last_d2h = saved.d2h_done
        self._current.seen[_geometry(t)] = (weakref.ref(t), t._version, saved, (t.size(), t.stride()))
        self._current.saved.append(weakref.ref(saved))
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += t.numel() * t.element_size()
        return saved

    def _again(self, t: torch.Tensor) -> Any:
        """The _Saved of t (or a _View of it) if this block's forward already offloaded the run of memory t's
        elements lie in (through a tensor still alive, unmodified since)."""
        hit = self._current.seen.get(_geometry(t))
        if hit is None or hit[0]() is None or t._version != hit[1]:
            return None
        self.stats.deduplicated += 1
        self.stats.deduplicated_bytes += t.numel() * t.element_size()
        if hit[3] == (t.size(), t.stride()):
            return hit[2]
        return _View(hit[2], t.size(), t.stride())

    def unpack(self, packed: Any) -> torch.Tensor:
        """Backward: the device copy of a packed tensor, ready on the stream that asks for it."""
        self.stats.unpacks += 1
        if isinstance(packed, _Distributed):
            local = packed.local
            local = self._unpack(local.base).as_strided(local.size, local.stride, 0) if isinstance(local, _View) \
                else self._unpack(local)
            return DTensor.from_local(local, packed.mesh, packed.placements, run_check=False, shape=packed.shape,
                                      stride=packed.stride)
        if isinstance(packed, _View):
            return self._unpack(packed.base).as_strided(packed.size, packed.stride, 0)
        if not isinstance(packed, _Saved):
            return packed
        return self._unpack(packed)

    def _unpack(self, packed: _Saved) -> torch.Tensor:
        group = packed.group
        if not group.started:  # backward reached this block: its copies back (unless prefetched), then the next
            group.started = True
            if not group.fetched:
                self._fetch(group)
                self.stats.fetched_groups += 1
            prev = group.prev() if group.prev is not None else None
            if prev is not None and not prev.fetched:  # overlapped with this block's backward
                self._fetch(prev)
                self.stats.prefetched_groups += 1
        compute = self.ops.current_stream()
        self.ops.wait_event(compute, packed.h2d_done)
        self.ops.record_stream(packed.dev, compute)  # allocated on the side stream, used (and freed) here
        return packed.dev

    def _fetch(self, group: _Group) -> None:
        """Start the copies back of every tensor of `group` still held by a graph, each after its copy out."""
        side = self.ops.side_stream()
        for ref in group.saved:
            saved = ref()
            if saved is None or saved.dev is not None:
                continue
            self.ops.wait_event(side, saved.d2h_done)
            saved.dev = self.ops.to_device(saved.host, saved.device, side)
            saved.h2d_done = self.ops.record_event(side)
        group.fetched = True


def _offloaded(forward: Callable, offloader: Offloader, index: int) -> Callable:
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation saves nothing
            return forward(*args, **kwargs)
        with offloader.block(index):
            return forward(*args, **kwargs)
    return run


def offload_blocks(blocks: list[nn.Module], device: torch.device, min_bytes: int = MIN_BYTES) -> Offloader:
    """Offload the saved tensors of every block's forward (wrapping `block.forward` as it is now, checkpointed or
    not: apply after activation checkpointing). Parameter names do not change. Returns the Offloader (its stats)."""
    device = torch.device(device)
    ops = CudaOps(device) if device.type == "cuda" else HostOps()
    offloader = Offloader(ops, min_bytes)
    for i, block in enumerate(blocks):
        block.forward = _offloaded(block.forward, offloader, i)
    return offloader


def check_offload(offload: bool, tensor: int, pipeline: int, compile: bool) -> None:
    """The layouts the offload does not serve, refused in one line: none now (tensor parallel's DTensors move their
    local tensors, pipeline parallel and compile compose with it); the arguments keep the decision in one place."""
    return None
