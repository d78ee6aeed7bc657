"""The MoE transformer's parallel plan: the dense pipeline split, and expert parallel as a mesh dimension of the
family's own ("ep", `parallel.expert`).

Expert parallel is carved out of the sharded data-parallel ranks (model.MeshDim): each rank of an expert-parallel
group reads its own batch and holds num_experts / ep of every layer's experts (their weights DTensors, Shard(0)
over "ep"); the MoE layer sends each token to the rank holding its expert and back (all-to-all with uneven
splits). FSDP shards the experts over the data-parallel ranks left (InternEvo's expert_zero1 = -1) and everything
else over all of them. Tensor parallel of MoE models is not implemented yet (rules.py refuses it).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Shard, distribute_tensor

from ...errors import ConfigError
from ..internlm.parallelize import split_stages, stage_io
from ..moe import MoEFeedForward
from ..spec import MeshDim, MeshDimContext, ModelInputs, ParallelPlan


def resolve_expert_parallel(requested: int, dp_shard: int, inputs: ModelInputs) -> int:
    """InternEvo's parallel.expert: <= 0 is the whole sharded data-parallel group, or the number of experts when
    there are fewer (each rank then holds one expert); otherwise the size asked for."""
    experts = int(inputs.model.num_experts) if inputs is not None else dp_shard
    size = min(dp_shard, experts) if requested <= 0 else requested
    if dp_shard % size:
        raise ConfigError(f"parallel.expert ({size}) must divide the sharded data-parallel size ({dp_shard}): expert "
                          "parallel is carved out of the data-parallel ranks")
    return size


def shard_experts(model: nn.Module, ctx: MeshDimContext) -> list[nn.Module]:
    """Every MoE layer of `model` (this pipeline stage's) keeps its share of the experts; returns the experts'
    modules (FSDP shards them over the data-parallel ranks that remain)."""
    sharded = []
    for block in model.layers.values():
        ffn = block.feed_forward
        if not isinstance(ffn, MoEFeedForward):
            continue
        experts = ffn.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            setattr(experts, name, nn.Parameter(distribute_tensor(param.detach(), ctx.mesh, [Shard(0)])))
        ffn.set_expert_parallel(ctx.mesh.get_group(), ctx.size, ctx.rank)
        sharded.append(experts)
    return sharded


EXPERT_PARALLEL = MeshDim(name="ep", key="expert", apply=shard_experts, resolve=resolve_expert_parallel,
                          description="experts sharded over data-parallel ranks")

MOE_PLAN = ParallelPlan(blocks=lambda model: list(model.layers.values()), split_stages=split_stages,
                        stage_io=stage_io, mesh_dims=(EXPERT_PARALLEL,))
