"""Layout-independent initialization: every parameter's initial value is a function of (seed, its name) only.

A model is built on the meta device, cut into pipeline stages, tensor-parallelized and FSDP-sharded, and only
then materialized: each rank allocates its shards (`to_empty`) and fills them here. A parameter's full value is
drawn from its own generator, seeded by the run's seed and the parameter's name, one parameter at a time; each
rank copies out its shard and drops the rest. So one process, any data / tensor / pipeline layout, and any
rank of a simulated job get bitwise the same initial weights, without any rank ever holding more than its
shards plus one full parameter, and without drawing the values of parameters it does not hold.
"""

from __future__ import annotations

import zlib
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of one parameter: seeded by the run's seed and a stable hash of the name."""
    return torch.Generator().manual_seed((int(seed) * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))


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


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, fill: Callable[[str, torch.Tensor, torch.Generator], None]) -> None:
    """Initialize every parameter of `model` (meta-built and materialized, possibly sharded) in place:
    `fill(name, full, generator)` writes the full fp32 value of parameter `name` into `full`."""
    for name, p in model.named_parameters():
        full = torch.empty(p.shape, dtype=torch.float32)  # DTensor.shape is the global shape
        fill(name, full, parameter_generator(seed, name))
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
