"""FSDP2 (`fully_shard`) for data parallel: InternLM's zero1 as shard / replicate (HSDP) mesh dimensions."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from ..distributed.parallel_dims import ParallelDims


def apply_fsdp(model: nn.Module, dims: ParallelDims, reshard_after_forward: bool = True) -> nn.Module:
    """Shard every block, then the root (embedding, norm, output), over the data-parallel mesh.

    zero1 <= 0: shard over all of dp; zero1 == 1: shard size 1, i.e. plain replication (DDP
    semantics: gradients all-reduced, full optimizer state per rank); zero1 == k: shard within
    groups of k, replicate across them (HSDP).
    """
    mesh = dims.mesh
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    for layer in model.layers.values():
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    return model
