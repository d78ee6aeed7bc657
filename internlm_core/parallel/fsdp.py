"""FSDP2 (`fully_shard`) for data parallel: InternLM's zero1 as shard / replicate (HSDP) mesh dimensions."""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from ..distributed.parallel_dims import ParallelDims
from ..loss_norm import grad_divisor


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
    DTensors on the "tp" dimension of the same mesh and FSDP shards them further (2-D). Context-parallel ranks
    hold the same parameters: the shard dimension is dp_shard x cp ("dp_shard_cp", torchtitan's layout).
    Gradients are averaged over the data (x context) parallel ranks: FSDP's mean over D = dp x cp ranks, which the
    loss contract's factors assume (loss_norm.py).

    reshard_after_forward: free the gathered block parameters after forward (ZeRO-3 memory); pipeline
    parallel passes False, since every micro-batch's backward would gather them again.
    """
    dp_mesh = _data_mesh(dims, "dp_shard_cp")
    mp = mp_policy or MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    for root in roots:
        # the root's own parameters (embedding, norm, output) are used first thing in backward: keep them gathered
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp)


def _data_mesh(dims: ParallelDims, shard: str):
    """The data-parallel mesh FSDP shards over: `shard` ("dp_shard_cp": dp_shard x context, or "dp_shard_rest" /
    "dp_shard_rest_cp" for the modules a family's own dimension sharded), with the replicas as an outer dimension
    (HSDP)."""
    if dims.dp_replicate > 1:
        return dims.mesh["dp_replicate", shard]
    return dims.submesh(shard)


def even_shard_placement(shards: int) -> Callable[[nn.Parameter], Optional[Shard]]:
    """FSDP's placement for a parameter a family's dimension already cut: dim 0 (FSDP's default) when its local
    size there splits evenly over the `shards` ranks, else the first dimension that does, else the largest. Why:
    with as many expert-parallel ranks as experts (Mixtral's 8 on ep 8), each rank holds one expert, and dim 0
    (size 1) over the remaining data-parallel ranks would leave the whole expert on one of them and none on the
    others (torchtitan shards experts on dim 1 in that case)."""
    def choose(param: nn.Parameter) -> Optional[Shard]:
        shape = tuple((param.to_local() if isinstance(param, DTensor) else param).shape)
        if not shape or shape[0] % shards == 0:
            return None  # FSDP's default, Shard(0)
        even = [d for d, n in enumerate(shape) if n % shards == 0]
        return Shard(even[0] if even else max(range(len(shape)), key=lambda d: shape[d]))
    return choose


def apply_fsdp_to_dim_modules(modules: list[nn.Module], dims: ParallelDims, reshard_after_forward: bool = True,
                              mp_policy: Optional[MixedPrecisionPolicy] = None) -> None:
    """FSDP for the modules a family's own dimension sharded (model.MeshDim), before the blocks that hold them:
    sharded over the remaining data-parallel ranks x the context ranks ("dp_shard_rest_cp"; their parameters
    already differ along the family's dimension, and context ranks hold the same ones), their gradients averaged
    over every data x context rank (the forward combined the family dimension's tokens, so each gradient already
    sums its ranks' contributions: FSDP divides by the loss contract's D = dp x cp, not by the ranks it reduces
    over; sums with separate scaling, which every backend supports)."""
    if not modules:
        return
    mesh = _data_mesh(dims, "dp_shard_rest_cp" if dims.cp > 1 else "dp_shard_rest")
    mp = mp_policy or MixedPrecisionPolicy()
    placement = even_shard_placement(mesh.size(-1))
    for module in modules:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                    shard_placement_fn=placement)
        module.set_gradient_divide_factor(float(grad_divisor(dims.dp, dims.cp)))  # the loss contract's D
        if mesh.size() > 1:
            # plain sums, then one division: gloo has no PREMUL_SUM. (On one rank FSDP divides by the factor
            # without a collective; forcing sums there would divide twice, torch 2.13.)
            module.set_force_sum_reduction_for_comms(True)
