"""The MoE transformer's parallel plan: the dense pipeline split, and expert parallel as a mesh dimension of the
family's own ("ep", `parallel.expert`).

Expert parallel is carved out of the sharded data-parallel ranks (model.MeshDim): each rank of an expert-parallel
group reads its own batch and holds num_experts / ep of every layer's experts (their weights DTensors, Shard(0)
over "ep"); the MoE layer sends each token to the rank holding its expert and back (all-to-all with uneven
splits). FSDP shards the experts over the data-parallel ranks left (InternEvo's expert_zero1 = -1) and everything
else over all of them.

Tensor parallel (InternEvo's `parallel.expert.no_tp=True`, the only mode here): attention, embedding, output and a
dense block's FFN as the dense plan shards them; the shared experts like a dense FFN (w1/w3 column-, w2
row-parallel); the router, the mixing coefficient and the routed experts are replicated over the tensor-parallel
ranks (DTensors, Replicate), and every tensor-parallel rank routes the same (gathered) tokens through them, so
their gradients agree without communication. Under sequence parallel the MoE layer's input is gathered along the
sequence and its output sliced back (a redundancy of tensor-size in the experts' work, which is what no_tp costs).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInputOutput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from ...errors import ConfigError
from ..internlm.parallelize import apply_tensor_parallel, block_plan, split_stages, stage_io
from ..moe import MoEFeedForward
from ..mtp import mtp_blocks
from ..parallel_styles import ReplicateParallel
from ..spec import MeshDim, MeshDimContext, ModelInputs, ParallelPlan, TensorParallelOptions


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
    for block in list(model.layers.values()) + mtp_blocks(model):  # model.mtp's blocks too
        ffn = block.feed_forward
        if not isinstance(ffn, MoEFeedForward):
            continue
        experts = ffn.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            full = param.detach()
            full = full.to_local() if hasattr(full, "to_local") else full  # replicated over tensor parallel
            setattr(experts, name, nn.Parameter(distribute_tensor(full, ctx.mesh, [Shard(0)])))
        ffn.set_expert_parallel(ctx.mesh.get_group(), ctx.size, ctx.rank)
        sharded.append(experts)
    return sharded


class ReplicateParameters(ParallelStyle):
    """The module's own parameters as Replicate DTensors on the mesh; its forward, inputs, outputs and buffers stay
    plain (the MoE layer computes on the parameters' local parts)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()]),
                                                           requires_grad=param.requires_grad))
        return distribute_module(module, device_mesh, partition)


def moe_layer_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """One block's tensor-parallel plan: the dense one, or for a MoE block the layout of the module docstring."""
    ffn = block.feed_forward
    if not isinstance(ffn, MoEFeedForward):
        return block_plan(sequence_parallel)
    plan = {k: v for k, v in block_plan(sequence_parallel).items() if not k.startswith("feed_forward")}
    stream = Shard(1) if sequence_parallel else Replicate()
    plan["feed_forward"] = PrepareModuleInputOutput(
        input_layouts=(stream,), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(),), desired_output_layouts=(stream,), use_local_output=True)
    plan["feed_forward.gate"] = ReplicateParameters()
    plan["feed_forward.experts"] = ReplicateParameters()
    if ffn.shared_experts is not None:
        plan["feed_forward.shared_experts.w1"] = ColwiseParallel()
        plan["feed_forward.shared_experts.w3"] = ColwiseParallel()
        plan["feed_forward.shared_experts.w2"] = RowwiseParallel()
        if ffn.coefficient is not None:  # InternEvo's mix (DeepSeek's shared experts are added: none)
            plan["feed_forward.coefficient"] = ReplicateParallel()
    return plan


def apply_moe_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, options: TensorParallelOptions) -> None:
    """Shard `model` (a MoETransformer or one pipeline stage of it) over `tp_mesh`, in place."""
    apply_tensor_parallel(model, tp_mesh, options, layer_plan=moe_layer_plan)


EXPERT_PARALLEL = MeshDim(name="ep", key="expert", apply=shard_experts, resolve=resolve_expert_parallel,
                          description="experts sharded over data-parallel ranks")

MOE_PLAN = ParallelPlan(blocks=lambda model: list(model.layers.values()) + mtp_blocks(model),
                        split_stages=split_stages,
                        stage_io=stage_io, apply_tensor_parallel=apply_moe_tensor_parallel, mesh_dims=(EXPERT_PARALLEL,))
