"""FSDP2 (`fully_shard`) for data parallel: InternLM's zero1 as shard / replicate (HSDP) mesh dimensions."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..distributed.parallel_dims import ParallelDims


def mixed_precision_policy(compute_dtype: torch.dtype, reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2's mixed precision: parameters all-gathered in the compute dtype (bf16/fp16: half the bytes of fp32,
    and no autocast copy of each weight afterwards), gradients reduced in `reduce_dtype` (fp32), the sharded
    master weights and AdamW's state in fp32. fp32 runs: the default policy (no casts)."""
    if compute_dtype == torch.float32:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype)


def apply_fsdp(blocks: list[nn.Module], roots: list[nn.Module], dims: ParallelDims,
               reshard_after_forward: bool = True, mp_policy: Optional[MixedPrecisionPolicy] = None) -> None:
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
    mp = mp_policy or MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    for root in roots:
        # the root's own parameters (embedding, norm, output) are used first thing in backward: keep them gathered
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)
