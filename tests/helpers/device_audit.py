"""The device audit: CPU tests that fail where a CUDA run would put a tensor on the wrong device.

On a CPU machine every process group is gloo and every tensor lives on the CPU, so `torch.zeros(...)` without
`device=` (which on a CUDA run makes a CPU tensor that NCCL rejects) cannot be told from a tensor made for the run's
device. Inside `audit_devices("cuda")`:

- the run's device is `AUDITED = torch.device("cuda", 0)`: a factory or a move that names it (`device=`, `.to()`,
  `.cuda()`) makes a CPU tensor marked as being on it; whatever is computed from marked tensors stays marked, and
  `.device` of a marked tensor says cuda:0; `.cpu()` / `.to("cpu")` gives an unmarked one;
- every process group's device is `AUDITED` (internlm_core.utils.collectives' seam, `placement_view`), so each
  collective accepts marked tensors only: an unmarked (host) tensor raises DevicePlacementError as NCCL would fail.

The values are real (the data stays on the CPU and gloo moves it), so the code under audit runs to its end.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from internlm_core.utils import collectives

AUDITED = torch.device("cuda", 0)
_CPU = torch.device("cpu")


class OnAuditedDevice(torch.Tensor):
    """A CPU tensor that stands for one on the audited device (default subclass propagation keeps the mark)."""


def marked(t: Any) -> bool:
    return isinstance(t, OnAuditedDevice)


def _mark(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and not marked(value):
        with torch._C.DisableTorchFunctionSubclass():
            return value.as_subclass(OnAuditedDevice)
    return value


def _unmark(value: Any) -> Any:
    if marked(value):
        with torch._C.DisableTorchFunctionSubclass():
            return value.as_subclass(torch.Tensor)
    return value


def _audited(device: Any) -> bool:
    return device is not None and torch.device(device).type == AUDITED.type


def _to_target(args: tuple, kwargs: dict) -> Optional[torch.device]:
    """The device of a `Tensor.to(...)` call (None: the call names none)."""
    rest = list(args[1:])
    if rest and isinstance(rest[0], torch.Tensor):  # .to(other): the other tensor's device
        return AUDITED if marked(rest[0]) else rest[0].device
    device = kwargs.get("device")
    if device is None and rest and isinstance(rest[0], (str, torch.device, int)):
        device = rest[0]
    return torch.device(device) if device is not None else None


# ops that take a host tensor beside a CUDA one (copies and indexing); every other op must not mix them
_CROSS_DEVICE = {torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
                 torch.Tensor.new_tensor}


def _check_not_mixed(func, args: tuple, kwargs: dict) -> None:
    """DevicePlacementError when `func` gets a marked tensor and a host tensor of one or more dimensions (CUDA
    kernels take 0-dim host tensors as scalars, nothing larger)."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    if not any(marked(t) for t in tensors):
        return
    host = [t for t in tensors if not marked(t) and t.dim() > 0 and t.device.type == "cpu"]
    if host:
        name = getattr(func, "__name__", str(func))
        raise collectives.DevicePlacementError(
            f"{name} mixes a tensor on {AUDITED} with a {tuple(host[0].shape)} {host[0].dtype} host tensor "
            f"(a CUDA run fails here)")


# property reads reach a mode as the descriptor's `__get__` (a new method-wrapper each time: compare with ==)
_DEVICE_GETTER = torch.Tensor.device.__get__
_IS_CUDA_GETTER = torch.Tensor.is_cuda.__get__


class _AuditMode(TorchFunctionMode):
    """Factories and moves to the audited device make marked CPU tensors; `.device` of a marked tensor is it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == _DEVICE_GETTER and marked(args[0]):
            return AUDITED
        if func == _IS_CUDA_GETTER and marked(args[0]):
            return True
        if func is torch.Tensor.cuda:
            return _mark(_unmark(args[0]).clone())
        if func is torch.Tensor.cpu:
            return _unmark(args[0]).clone() if marked(args[0]) else func(*args, **kwargs)
        if func is torch.Tensor.to:
            return self._to(func, args, kwargs)
        if _audited(kwargs.get("device")):
            kwargs["device"] = _CPU
            return _mark(func(*args, **kwargs))
        if func not in _CROSS_DEVICE:
            _check_not_mixed(func, args, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _to(func, args: tuple, kwargs: dict):
        target = _to_target(args, kwargs)
        src = args[0]
        if target is None:
            return func(*args, **kwargs)
        dtype = kwargs.get("dtype") or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
        plain = _unmark(src)
        if dtype is not None:
            plain = plain.to(dtype)
        if target.type == AUDITED.type:
            return src if marked(src) and dtype in (None, src.dtype) else _mark(plain.clone())
        if marked(src):  # to the host: an unmarked copy
            return plain.clone()
        return func(*args, **kwargs)


class _AuditView(collectives.PlacementView):
    def group_device(self, group):
        return AUDITED

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return AUDITED if marked(tensor) else _CPU

    def plain(self, tensor: torch.Tensor) -> torch.Tensor:
        return _unmark(tensor)


@contextlib.contextmanager
def audit_devices(device_type: str = "cuda") -> Iterator[torch.device]:
    """Run the block as if the run's device and every process group's device were `device_type` (see the module
    docstring); yields the device to hand the code under audit as its run device."""
    if device_type != AUDITED.type:
        raise ValueError(f"the audit pretends {AUDITED.type}, got {device_type!r}")
    with _AuditMode(), collectives.placement_view(_AuditView()):
        yield AUDITED
