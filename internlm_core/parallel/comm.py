"""The bytes FSDP communicates per step on this rank: gathered parameters and reduce-scattered gradients.

    counter = CommCounter.attach(model)   # every FSDP unit of the model (no-op without FSDP)
    ...one step...
    counter.pop()  # {"comm/gathered_bytes": ..., "comm/reduced_bytes": ..., "comm/gathers": ..., "comm/reduces": ...}

FSDP2 takes custom collectives (`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`); the ones here
do what its defaults do (one all-gather / reduce-scatter on the unit's group, buffers from `torch.empty`) and add
each call's size: the unsharded bytes of the unit in the dtype that travels (the all-gather's output: 16-bit
weights under the mixed-precision policy; the reduce-scatter's input: fp32 gradients). That is a collective's
"size" as NCCL's tests report it; the bytes on the wire per rank are (n - 1) / n of it for n ranks in the group.
Not counted: HSDP's all-reduce across replicas, tensor-parallel collectives, pipeline sends. Under the fake
backend (`train.py --simulate`) the calls move nothing but are counted all the same: the job's figures.
`tools/estimate.py` predicts the same two numbers (internlm_core/estimate.py `Communication`).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
# the interfaces `set_custom_all_gather` / `set_custom_reduce_scatter` take (torch 2.13 keeps them here)
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..utils import collectives


class CommCounter:
    """Running totals of FSDP's collectives on this rank since the last `pop`."""

    def __init__(self) -> None:
        self.units = 0
        self.reset()

    def reset(self) -> None:
        self.gathered = self.reduced = self.gathers = self.reduces = 0

    def pop(self) -> dict[str, int]:
        """The totals since the last pop (or reset), as metrics; then zero."""
        out = {"comm/gathered_bytes": self.gathered, "comm/reduced_bytes": self.reduced,
               "comm/gathers": self.gathers, "comm/reduces": self.reduces}
        self.reset()
        return out

    @classmethod
    def attach(cls, model: nn.Module) -> "CommCounter":
        """A counter fed by every FSDP unit of `model` (its own custom collectives, set on each unit)."""
        counter = cls()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_CountingAllGather(counter))
                module.set_custom_reduce_scatter(_CountingReduceScatter(counter))
                counter.units += 1
        return counter


_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def float8_as_bytes(output: torch.Tensor, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An all-gather's buffers, float8 ones as uint8 views of the same memory (bitwise the float8 values): gloo has
    no float8 dtype ("Invalid scalar type"). Every custom all-gather set on an FSDP unit sends through this, so the
    one set last (the counter here, model.fp8's in parallel/float8.py) never undoes the other's transport."""
    if output.dtype in _FLOAT8:
        return output.view(torch.uint8), input.view(torch.uint8)
    return output, input


def _empty(size: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(size, dtype=dtype, device=device)


class _CountingAllGather(AllGather):
    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        self.counter.gathered += output_tensor.numel() * output_tensor.element_size()
        self.counter.gathers += 1
        output_tensor, input_tensor = float8_as_bytes(output_tensor, input_tensor)
        return collectives.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter(ReduceScatter):
    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return _empty(size, dtype, device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        self.counter.reduced += input_tensor.numel() * input_tensor.element_size()
        self.counter.reduces += 1
        return collectives.reduce_scatter_single(output_tensor, input_tensor, group=group, op=op, async_op=async_op)
