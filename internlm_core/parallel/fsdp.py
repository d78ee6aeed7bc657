"""FSDP2 (`fully_shard`) for data parallel: InternLM's zero1 as shard / replicate (HSDP) mesh dimensions."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import fully_shard

from ..distributed.parallel_dims import ParallelDims


def apply_fsdp(blocks: list[nn.Module], roots: list[nn.Module], dims: ParallelDims,
               reshard_after_forward: bool = True) -> None:
    """Shard every block, then each root (the model, or each pipeline chunk: what is left, e.g. embedding,
    norm, output), over the data-parallel mesh.

    zero1 <= 0: shard over all of dp; zero1 == 1: shard size 1, i.e. plain replication (DDP
    semantics: gradients all-reduced, full optimizer state per rank); zero1 == k: shard within
    groups of k, replicate across them (HSDP). Under tensor parallel the parameters are already
    DTensors on the "tp" dimension of the same mesh and FSDP shards them further (2-D).
    Gradients are averaged over the data-parallel ranks, as the loss is a mean over the global batch.

    reshard_after_forward: free the gathered block parameters after forward (ZeRO-3 memory); pipeline
    parallel passes False, since every micro-batch's backward would gather them again.
    """
    mesh = dims.mesh
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward)
    for root in roots:
        # the root's own parameters (embedding, norm, output) are used first thing in backward: keep them gathered
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False)
