"""Count, on the CPU, what would make the host wait for the GPU in a CUDA run: `HostSyncs`.

A CPU run has one device, so the counter emulates the CUDA run's two: every tensor is taken to be on the device
(the run's GPU) except those known to be on the host. Host tensors are the ones the test marks (`host(...)`: the
loader's batch), the ones torch creates without a `device` argument (`torch.tensor([..])`, `torch.arange(n)`,
...), the results of a device-to-host copy, and whatever is computed from host tensors only; a tensor made before
the counter started and not marked counts as a device tensor (a host read of a cached host tensor then shows as
a sync: mark such tensors). Two modes run
together: a TorchFunctionMode sees the Python calls (copies, `tolist`, factories), a TorchDispatchMode the ATen
ops (scalar reads, data-dependent shapes, also inside composite functions).

Counted (each one sync on CUDA when its input is on the device), by kind:
    scalar_read        _local_scalar_dense (item, int(), float(), bool() of a tensor), is_nonzero, equal
    data_shape         nonzero, masked_select, argwhere, index / index_put with a boolean mask (x[mask])
    bincount           bincount (on CUDA: a max read for the size, then the counts)
    unique             _unique, _unique2, unique_dim, unique_consecutive, unique_dim_consecutive
    repeat_interleave  repeat_interleave with a repeats tensor and no output_size
    d2h                tolist, numpy, cpu(), to("cpu") of a device tensor
    h2d                a host tensor's to(device) / cuda() / copy into a device tensor without non_blocking and
                       not through `utils.transfer.to_device` (which pins on CUDA), and torch.tensor / as_tensor
                       of Python data with device= the run's device (pageable memory)

Host and device are both the CPU here, so a device argument is read by its spelling: None or a string ("cpu")
names the host, a torch.device (`self.device`, `x.device`) the run's device. What the CPU cannot show (so not
counted): whether host memory is pinned (a copy with non_blocking=True, or through `to_device`, is taken as
pinned; on CUDA a non_blocking copy of pageable memory still waits); copies torch makes inside its own functions
(FSDP's root moving its inputs, which it does for non-CPU devices only); CUDA events and stream syncs
(`Event.synchronize`, `torch.cuda.synchronize`); copies inside a custom autograd Function's backward (torch runs
it with torch function modes off: only its ATen ops are seen); collectives that the host waits on (gloo is synchronous on the
CPU, NCCL is not); ops inside a tensor subclass's dispatch (DTensor's local ops) and inside native kernels.
"""

from __future__ import annotations

import collections
import sys
import traceback
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from internlm_core.utils import transfer

SCALAR_READS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}
DATA_SHAPE = {"nonzero", "masked_select", "argwhere"}
UNIQUE = {"_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive"}
FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "empty", "full", "rand", "randn", "randint",
             "randperm", "linspace", "zeros_like", "ones_like", "empty_like", "full_like"}
_LIKE = {"zeros_like", "ones_like", "empty_like", "full_like"}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _target(args: tuple, kwargs: dict) -> Any:
    """The device argument of a `Tensor.to(...)` call (positional or keyword; a tensor's device), None if none."""
    device = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.Tensor):
            device = a.device
    return device


def _from_transfer() -> bool:
    """Whether the current torch call comes from `internlm_core.utils.transfer.to_device` (pinned on CUDA)."""
    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back
        if frame is None or frame.f_code is transfer.to_device.__code__:
            return frame is not None
    return False


class HostSyncs:
    """Context manager counting host syncs (see the module docstring). `counts` maps kind -> count, `events` the
    (kind, op) pairs in order, `sites` where each happened, `total` their number; `host(*tensors)` marks tensors
    that live on the host."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.events: list[tuple[str, str]] = []
        self.sites: list[str] = []  # where each event happened: the innermost internlm_core line
        self._host = WeakTensorKeyDictionary()
        self._modes = (_Functions(self), _Ops(self))

    def names_host(self, device: Any) -> bool:
        """Whether a device argument names the host: None (torch's default) or a string of the CPU ("cpu"); a
        torch.device of the run's type names the run's device (the code's `self.device`, `x.device`)."""
        if device is None:
            return True
        if isinstance(device, str):
            return torch.device(device).type == "cpu"
        return torch.device(device).type != self.device.type

    @property
    def counts(self) -> collections.Counter:
        return collections.Counter(kind for kind, _ in self.events)

    @property
    def total(self) -> int:
        return len(self.events)

    def host(self, *trees: Any) -> None:
        """Mark every tensor in `trees` (tensors, lists, dicts) as a host tensor."""
        for t in _tensors(trees):
            self._host[t] = True

    def is_host(self, t: torch.Tensor) -> bool:
        return t in self._host

    def _from_host(self, tensors: list[torch.Tensor]) -> bool:
        return bool(tensors) and all(t in self._host for t in tensors)

    def record(self, kind: str, op: str) -> None:
        self.events.append((kind, op))
        stack = traceback.extract_stack()[:-2]
        ours = [f for f in stack if "internlm_core" in f.filename] or stack[-1:]
        self.sites.append(f"{kind} {op} at {ours[-1].filename.rsplit('/', 3)[-1]}:{ours[-1].lineno}")

    def __enter__(self) -> "HostSyncs":
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)


class _Functions(TorchFunctionMode):
    """Copies between host and device, and where new tensors live."""

    def __init__(self, counter: HostSyncs):
        super().__init__()
        self.c = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is not None and name in ("tolist", "numpy", "cpu", "to", "cuda", "copy_"):
            handled, out = self._copy(func, name, src, args, kwargs)
            if handled:
                return out
        out = func(*args, **kwargs)
        device = kwargs.get("device")
        if name in FACTORIES and name not in _LIKE and not (name == "as_tensor" and src is not None):
            if self.c.names_host(device):
                self.c.host(out)
            elif name in ("tensor", "as_tensor"):
                self.c.record("h2d", name)  # Python data: pageable memory
        elif self.c._from_host(_tensors((args, kwargs))) and not (name in _LIKE and device is not None):
            self.c.host(out)
        return out

    def _copy(self, func, name: str, src: torch.Tensor, args: tuple, kwargs: dict) -> tuple[bool, Any]:
        """(True, result) for a copy between host and device (counted), (False, None) for anything else."""
        host = self.c.is_host(src)
        target = _target(args, kwargs) if name == "to" else None
        to_host = name in ("tolist", "numpy", "cpu") or (target is not None and self.c.names_host(target))
        if name == "copy_":  # dst.copy_(src): a host source into a device tensor
            source = args[1] if len(args) > 1 else kwargs.get("src")
            blocking = not (kwargs.get("non_blocking", False) or (len(args) > 2 and args[2]))
            if not host and isinstance(source, torch.Tensor) and self.c.is_host(source) and blocking:
                self.c.record("h2d", name)
            return False, None
        if to_host and not host:
            self.c.record("d2h", name)
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor):
                out = out.clone() if out is src else out  # the host copy is a tensor of its own
                self.c.host(out)
            return True, out
        to_device = name == "cuda" or (target is not None and not self.c.names_host(target))
        if to_device and host:
            if not kwargs.get("non_blocking", False) and not _from_transfer():
                self.c.record("h2d", name)
            out = func(*args, **kwargs)
            out = out.clone() if out is src else out  # the device copy is not the host tensor
            self.c._host.pop(out, None)
            return True, out
        return False, None


class _Ops(TorchDispatchMode):
    """The ATen ops that read a device value on the host."""

    def __init__(self, counter: HostSyncs):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        inputs = _tensors((args, kwargs))
        on_device = not self.c._from_host(inputs)
        if on_device and inputs:
            kind = self._kind(func, name, args, kwargs)
            if kind is not None:
                self.c.record(kind, name)
        out = func(*args, **kwargs)
        if inputs and not on_device:
            self.c.host(out)
        return out

    @staticmethod
    def _kind(func, name: str, args: tuple, kwargs: dict) -> Optional[str]:
        if name in SCALAR_READS:
            return "scalar_read"
        if name in DATA_SHAPE:
            return "data_shape"
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and len(args) > 1:
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                return "data_shape"
        if name == "bincount":
            return "bincount"
        if name in UNIQUE:
            return "unique"
        if name == "repeat_interleave" and kwargs.get("output_size") is None:
            repeats = args[0] if func._overloadname == "Tensor" else (args[1] if len(args) > 1 else None)
            if isinstance(repeats, torch.Tensor):
                return "repeat_interleave"
        return None
