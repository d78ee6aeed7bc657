"""The one door for collectives: every collective the trainer, metrics, monitors, checkpointing and pipeline issue goes
through here, and every tensor handed to one is checked to be on its process group's device.

NCCL takes CUDA tensors only ("No backend type associated with device type cpu"); gloo takes CPU tensors. A CPU
tensor that a CUDA run should never have made (`torch.zeros(...)` without `device=` on a pipeline stage that has
no outputs to count) passes every gloo test and crashes the first NCCL step. Here `group_device(group)` says where
a tensor for a collective on `group` lives, and the tensor collectives below raise `DevicePlacementError` for a
tensor anywhere else, before the backend sees it, naming the collective, the tensor and the group's backend.

Object collectives (`all_gather_object`, `broadcast_object_list`) pickle into tensors torch places itself (under
NCCL on the current CUDA device, which `distributed.launch` sets); they come through here too, so that one place
lists every collective the package issues (tests/unit/test_collective_placement.py holds the package to it).

The check sees devices through `PlacementView`. On a CPU machine every group is gloo and every tensor is on the
CPU, so a wrong placement cannot show; the device audit of the tests (tests/helpers/device_audit.py,
`audit_devices("cuda")`) installs a view in which the groups' device is CUDA and only tensors made for that device
count as on it, so that the CPU tests fail where a CUDA run would.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


class DevicePlacementError(RuntimeError):
    """A tensor handed to a collective is not on its process group's device (a bug in the caller, not user input)."""


def dist_ready() -> bool:
    """True when a default process group is initialized (a single process without one issues no collectives)."""
    return dist.is_available() and dist.is_initialized()


def backend_of(group: Group = None) -> str:
    """The backend name of `group` (None: the default group), lower case: "nccl", "gloo", "fake", ..."""
    return str(dist.get_backend(group)).lower()


class PlacementView:
    """How the collectives see devices: the group's device from its backend, a tensor's from the tensor."""

    def group_device(self, group: Group) -> Optional[torch.device]:
        """Where tensors for a collective on `group` must be; None: anywhere (a simulated job's fake backend)."""
        backend = backend_of(group)
        if "nccl" in backend:
            return torch.device("cuda", torch.cuda.current_device())
        if backend == "fake":
            return None
        return torch.device("cpu")

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device

    def plain(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor handed to torch.distributed."""
        return tensor


_VIEW: PlacementView = PlacementView()


@contextlib.contextmanager
def placement_view(view: PlacementView) -> Iterator[PlacementView]:
    """Use `view` for every check until the block ends (the device audit's seam)."""
    global _VIEW
    previous, _VIEW = _VIEW, view
    try:
        yield view
    finally:
        _VIEW = previous


def group_device(group: Group = None) -> torch.device:
    """The device a tensor for a collective on `group` (None: the default group) must be on: the current CUDA
    device under NCCL, the CPU under gloo (and without a process group)."""
    if not dist_ready():
        return torch.device("cpu")
    return _VIEW.group_device(group) or torch.device("cpu")


def _same(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    return actual.type != "cuda" or expected.index is None or actual.index in (None, expected.index)


def check_placement(op: str, tensor: torch.Tensor, group: Group = None) -> None:
    """DevicePlacementError unless `tensor` is on `group`'s device."""
    expected = _VIEW.group_device(group)
    if expected is None:
        return
    actual = _VIEW.device_of(tensor)
    if not _same(actual, expected):
        raise DevicePlacementError(
            f"{op} on a {backend_of(group)} process group: a {tuple(tensor.shape)} {tensor.dtype} tensor on {actual}, "
            f"expected one on {expected} (NCCL takes CUDA tensors only; make it with device=group_device(group) or "
            f"the run's device)")


def _checked(op: str, tensors: list[torch.Tensor], group: Group) -> list[torch.Tensor]:
    for t in tensors:
        check_placement(op, t, group)
    return [_VIEW.plain(t) for t in tensors]


# ---- tensor collectives ------------------------------------------------------------------------------------------

def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Group = None, async_op: bool = False) -> Any:
    """`dist.all_reduce`, in place, after the placement check."""
    (plain,) = _checked("all_reduce", [tensor], group)
    return dist.all_reduce(plain, op=op, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Group = None) -> Any:
    """`dist.all_gather` into `tensor_list`, after the placement check of every tensor."""
    plain = _checked("all_gather", [*tensor_list, tensor], group)
    return dist.all_gather(plain[:-1], plain[-1], group=group)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Group = None, async_op: bool = False) -> Any:
    """`dist.all_gather_into_tensor` (FSDP's all-gather), after the placement check. Every supported torch has
    that name (2.13 added `all_gather_single` as its new name and keeps this one as an alias; 2.11 has only this
    one): tests/unit/test_torch_api.py checks it against 2.11's and the newest's sources."""
    out, inp = _checked("all_gather_single", [output, input], group)
    return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group: Group = None,
                          op: Any = dist.ReduceOp.SUM, async_op: bool = False) -> Any:
    """`dist.reduce_scatter_tensor` (FSDP's reduce-scatter), after the placement check; the name every supported
    torch has (2.13's `reduce_scatter_single` is not in 2.11)."""
    out, inp = _checked("reduce_scatter_single", [output, input], group)
    return dist.reduce_scatter_tensor(out, inp, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes: Optional[list[int]] = None,
                      input_split_sizes: Optional[list[int]] = None, group: Group = None,
                      async_op: bool = False) -> Any:
    """`dist.all_to_all_single` (expert parallel's token exchange), after the placement check."""
    out, inp = _checked("all_to_all_single", [output, input], group)
    return dist.all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None, async_op: bool = False) -> Any:
    """`dist.broadcast` of global rank `src`'s `tensor` into `tensor` on every rank, after the placement check."""
    (plain,) = _checked("broadcast", [tensor], group)
    return dist.broadcast(plain, src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group: Group = None) -> None:
    """`dist.send` to global rank `dst`, after the placement check."""
    (plain,) = _checked("send", [tensor], group)
    dist.send(plain, dst, group=group)


def recv(tensor: torch.Tensor, src: int, group: Group = None) -> None:
    """`dist.recv` from global rank `src` into `tensor`, after the placement check."""
    (plain,) = _checked("recv", [tensor], group)
    dist.recv(plain, src, group=group)


def batch_isend_irecv(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
                      group: Group = None, tag: int = 0) -> list:
    """Post every send (tensor, global dst rank) and receive (tensor, global src rank into it) at once with
    `dist.batch_isend_irecv` (context parallel's ring), after the placement check; returns the works to wait on.
    The i-th send carries tag `tag` + i and matches the peer's i-th receive (gloo pairs messages by tag: exchanges
    in flight together need different `tag`s)."""
    plain = _checked("batch_isend_irecv", [t for t, _ in sends] + [t for t, _ in recvs], group)
    ops = [dist.P2POp(dist.isend, t, peer, group, tag=tag + i) for i, (t, (_, peer)) in enumerate(zip(plain, sends))]
    ops += [dist.P2POp(dist.irecv, t, peer, group, tag=tag + i)
            for i, (t, (_, peer)) in enumerate(zip(plain[len(sends):], recvs))]
    return dist.batch_isend_irecv(ops) if ops else []


def replica_all_reduce(manager: Any, tensor: torch.Tensor) -> bool:
    """The average of `tensor` over the replica groups of torchft's current quorum (`manager.allreduce`), in place,
    after the placement check: the replica groups talk over the run's own backend (parallel/fault_tolerance.py picks
    it so), so the tensor belongs where the run's own collectives want it. Fault tolerant: a lost peer does not
    raise; it returns False, and the manager then refuses to commit the step (the tensor may hold garbage)."""
    if dist_ready():
        check_placement("replica_all_reduce", tensor)
    return bool(manager.allreduce(_VIEW.plain(tensor)).wait())


# ---- object collectives and barriers -------------------------------------------------------------------------------

def all_gather_object(out: list, obj: Any, group: Group = None) -> None:
    """`dist.all_gather_object`: every rank's `obj` into `out`, in the group's rank order."""
    dist.all_gather_object(out, obj, group=group)


def broadcast_object_list(box: list, src: int = 0, group: Group = None) -> None:
    """`dist.broadcast_object_list`: global rank `src`'s objects into `box` on every rank."""
    dist.broadcast_object_list(box, src=src, group=group)


def barrier(group: Group = None) -> None:
    dist.barrier(group=group)
