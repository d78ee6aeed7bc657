"""Layout-independent initialization: every element's initial value is a function of (seed, its parameter's name, its
index in the parameter) only, computed where the element lives.

A model is built on the meta device, cut into pipeline stages, tensor-parallelized and FSDP-sharded, and only
then materialized: each rank allocates its shards (`to_empty`) and fills them here. Each rank finds the global
indices of its shard's elements (per dimension, from the DTensor's placements) and draws exactly those from the
parameter's counter-based stream (model/counter_rng.py), on the shard's device. So one process, any data / tensor /
pipeline / expert layout, and any rank of a simulated job get bitwise the same initial weights, and no rank draws,
holds or copies a value it does not keep.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ..utils.logging import get_logger
from .counter_rng import ParameterStream

logger = get_logger(__name__)

# counters per block (4 elements each): a CPU block stays in the caches, a CUDA block is a few large kernels
_BLOCK_COUNTERS = {"cpu": 1 << 15, "cuda": 1 << 22}
_MAX_RUN = 1 << 17  # elements of one row's run computed together


def parameter_generator(seed: int, name: str) -> ParameterStream:
    """The counter-based stream of one parameter: seeded by the run's seed and a 64-bit hash of the name."""
    return ParameterStream(seed, name)


def _chunk(index: torch.Tensor, parts: int, part: int) -> torch.Tensor:
    """Part `part` of `index` cut as torch.chunk cuts (equal parts rounded up, the last ones shorter or empty)."""
    size = -(-len(index) // parts)
    return index[part * size:(part + 1) * size]


def shard_indices(param: torch.Tensor) -> Optional[list[torch.Tensor]]:
    """The global index of this rank's elements along each dimension (its shard is their product); None when the
    placements are beyond Shard / _StridedShard / Replicate or the result disagrees with DTensor's own layout."""
    shape = tuple(param.shape)  # a DTensor's shape is the global one
    index = [torch.arange(n) for n in shape]
    if not isinstance(param, DTensor):
        return index
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        # (torch 2.13's _StridedShard is no Shard subclass; earlier ones were)
        if not isinstance(placement, (Shard, _StridedShard)):  # Partial: no elements of their own to draw
            return None
        d, parts, part = placement.dim % len(shape), mesh.size(mesh_dim), coordinate[mesh_dim]
        if isinstance(placement, _StridedShard):  # split in split_factor pieces, each cut in `parts`
            pieces = [_chunk(index[d], placement.split_factor, j) for j in range(placement.split_factor)]
            index[d] = torch.cat([_chunk(p, parts, part) for p in pieces])
        else:
            index[d] = _chunk(index[d], parts, part)
    # DTensor's own account of this rank's shard: its shape and where it starts
    local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, param.placements)
    sizes = tuple(len(i) for i in index)
    if sizes != tuple(local_shape) or sizes != tuple(param.to_local().shape):
        return None
    if any(len(i) and int(i[0]) != o for i, o in zip(index, offset)):
        return None
    return index


class ShardValues:
    """One parameter's local shard as `fill` sees it: `shape` is the parameter's global shape; `normal_`, `fill_`
    and `zero_` write this rank's elements as the whole parameter would hold them."""

    def __init__(self, local: torch.Tensor, index: Sequence[torch.Tensor], shape: tuple[int, ...],
                 stream: ParameterStream):
        self.local, self.index, self.shape, self.stream = local, list(index), shape, stream
        self.dtype = local.dtype

    def fill_(self, value: float) -> "ShardValues":
        self.local.fill_(value)
        return self

    def zero_(self) -> "ShardValues":
        self.local.zero_()
        return self

    def normal_(self, mean: float = 0.0, std: float = 1.0, generator: Optional[ParameterStream] = None
                ) -> "ShardValues":
        """N(mean, std) from the parameter's stream (`generator`: the one `fill` was given, or None for it)."""
        stream = self.stream if generator is None else generator
        if not isinstance(stream, ParameterStream):
            raise TypeError(f"{self.stream.name}: normal_ draws from the parameter's counter-based stream (the "
                            f"generator fill is given), not a {type(stream).__name__}: a sequential generator's "
                            f"values would depend on which elements a rank holds")
        draw_normal_(self.local, self.index, self.shape, stream, mean, std)
        return self


def _runs(index: list[torch.Tensor], shape: tuple[int, ...]) -> tuple[torch.Tensor, int]:
    """(the global flat index where each run of the shard starts, the run length): a run is the shard's last
    dimension when it is contiguous, else a single element."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    last = index[-1] if index else torch.zeros(1, dtype=torch.long)
    contiguous = len(index) > 0 and len(last) > 0 and int(last[-1]) - int(last[0]) + 1 == len(last)
    lead = index[:-1] if contiguous else index
    starts = torch.zeros((), dtype=torch.long)
    for i, d in zip(lead, range(len(lead))):
        starts = starts.unsqueeze(-1) + i * strides[d]
    if contiguous:
        starts = starts + int(last[0])
    return starts.reshape(-1), len(last) if contiguous else 1


@torch.no_grad()
def draw_normal_(local: torch.Tensor, index: list[torch.Tensor], shape: tuple[int, ...], stream: ParameterStream,
                 mean: float, std: float) -> None:
    """Write N(mean, std) into `local`, element (i_0, ..., i_n) of it being the parameter's element
    (index[0][i_0], ..., index[n][i_n]): rows of contiguous runs, a block of rows at a time."""
    if local.numel() == 0:
        return
    starts, length = _runs(index, shape)
    out = local.view(len(starts), length) if local.is_contiguous() else torch.empty(len(starts), length,
                                                                                      dtype=local.dtype,
                                                                                      device=local.device)
    device = local.device
    for s in range(0, length, _MAX_RUN):
        seg = min(_MAX_RUN, length - s)
        per_row = (seg + 3) // 4 + 1  # counters that cover a run of `seg` starting anywhere in a counter
        rows = max(1, _BLOCK_COUNTERS.get(device.type, _BLOCK_COUNTERS["cuda"]) // per_row)
        for r in range(0, len(starts), rows):
            first = (starts[r:r + rows] + s).to(device)
            counters = (first // 4).unsqueeze(1) + torch.arange(per_row, device=device)
            normals = stream.normals(counters).view(len(first), per_row * 4)
            values = normals.gather(1, (first % 4).unsqueeze(1) + torch.arange(seg, device=device))
            values *= std
            values += mean
            out[r:r + rows, s:s + seg] = values.to(torch.float32).to(local.dtype)
    if out.data_ptr() != local.data_ptr():
        local.copy_(out.view(local.shape))


def copy_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of `full` (the parameter's global value) into `param` (plain or DTensor)."""
    if isinstance(param, DTensor):
        # a replicated DTensor of the full value, redistributed to the parameter's placements: Replicate to
        # Shard (FSDP's, tensor parallel's, both) is a local slice, no communication
        whole = DTensor.from_local(full.to(param.device, param.dtype), param.device_mesh,
                                   [Replicate()] * param.device_mesh.ndim, run_check=False)
        param.to_local().copy_(whole.redistribute(param.device_mesh, param.placements).to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


Fill = Callable[[str, ShardValues, ParameterStream], None]


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, fill: Fill) -> None:
    """Initialize every parameter of `model` (meta-built and materialized, possibly sharded) in place:
    `fill(name, values, generator)` writes parameter `name` through `values` (a `ShardValues`: `normal_(mean, std,
    generator=generator)`, `fill_(v)`, `zero_()`), `generator` being the parameter's counter-based stream."""
    for name, p in model.named_parameters():
        stream = parameter_generator(seed, name)
        index = shard_indices(p)
        if index is not None:
            fill(name, ShardValues(p.to_local() if isinstance(p, DTensor) else p, index, tuple(p.shape), stream),
                 stream)
            continue
        # a placement this code does not lay out: the whole value, then this rank's part (same values, more work)
        logger.warning("init: %s has placements %s; drawing the whole parameter on this rank", name,
                       getattr(p, "placements", None))
        full = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        fill(name, ShardValues(full, [torch.arange(n) for n in p.shape], tuple(p.shape), stream), stream)
        copy_shard(p, full)


def materialize(model: nn.Module, device: torch.device | str, seed: int,
                buffer_device: Optional[torch.device] = None) -> nn.Module:
    """Allocate a meta-built model's (shards') storage on `device` and initialize it (the family's
    `init_weights(seed=..., buffer_device=...)`); returns the model."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, key))
    model.to_empty(device=device)
    for places in owners.values():  # to_empty allocates each module's parameters anew: tie shared ones again
        first = getattr(places[0][0], places[0][1])
        for module, key in places[1:]:
            setattr(module, key, first)
    model.init_weights(seed=seed, buffer_device=torch.device(buffer_device or device))
    return model
