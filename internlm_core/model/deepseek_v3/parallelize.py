"""DEEPSEEK_V3's parallel plan: the MoE families' (pipeline split, expert parallel as the "ep" mesh dimension,
the MoE layer's tensor-parallel layout) with latent attention's tensor-parallel layout.

Tensor parallel of latent attention (each rank computes its own heads, as transformers' base_model_tp_plan):
wq / wq_b and wkv_b column-parallel (heads), wo row-parallel; the low-rank projections wq_a and wkv_a and their
norms replicated (every rank computes the small latents in full from the gathered input). The gradient of a
replicated projection's output must be the sum over every rank's heads: for the query and key/value latents the
column-parallel wq_b / wkv_b input all-reduces it (DTensor's Replicate input); the shared rotary key bypasses
them, so its identity module `rope_key` declares its gradient Partial and the sum is taken there (one all-reduce
of [B, T, qk_rope_head_dim] per block).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..internlm.parallelize import _norm_style, apply_tensor_parallel, block_plan, split_stages, stage_io
from ..internlm_moe.parallelize import EXPERT_PARALLEL, moe_layer_plan
from ..moe import MoEFeedForward
from ..parallel_styles import ReplicateParallel
from ..mtp import mtp_blocks
from ..spec import ParallelPlan, TensorParallelOptions


class SumGradient(ParallelStyle):
    """An identity module whose input every rank holds in full and whose output's gradient each rank holds a
    part of: forward unchanged, backward the gradients summed over the mesh (Partial -> Replicate)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local(grad_placements=(Partial(),))

        return distribute_module(module, device_mesh, None, input_fn=to_dtensor, output_fn=to_local)


def latent_attention_plan(attention: nn.Module) -> dict[str, ParallelStyle]:
    """The plan of one LatentAttention (keys relative to the block)."""
    plan: dict[str, ParallelStyle] = {
        "attention.wkv_a": ReplicateParallel(), "attention.kv_a_norm": ReplicateParallel(),
        "attention.wkv_b": ColwiseParallel(), "attention.rope_key": SumGradient(),
    }
    if attention.wq is not None:
        plan["attention.wq"] = ColwiseParallel()
    else:
        plan.update({"attention.wq_a": ReplicateParallel(), "attention.q_a_norm": ReplicateParallel(),
                     "attention.wq_b": ColwiseParallel()})
    return plan


def latent_block_plan(block: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """A LatentBlock's plan: norms, the attention's input and wo as the dense block's, latent attention's
    projections (latent_attention_plan), the FFN as the MoE families' (dense SwiGLU or MoE layer)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    ffn = moe_layer_plan(block, sequence_parallel) if isinstance(block.feed_forward, MoEFeedForward) \
        else block_plan(sequence_parallel)
    plan = {k: v for k, v in ffn.items() if k.startswith(("feed_forward", "ffn_norm"))}
    plan.update({
        "attention_norm": _norm_style(sequence_parallel),
        "attention": PrepareModuleInput(input_layouts=(stream, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        **latent_attention_plan(block.attention),
    })
    return plan


def apply_latent_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, options: TensorParallelOptions) -> None:
    """Shard `model` (a DeepSeekV3Transformer or one pipeline stage of it) over `tp_mesh`, in place."""
    apply_tensor_parallel(model, tp_mesh, options, layer_plan=latent_block_plan)


DEEPSEEK_PLAN = ParallelPlan(blocks=lambda model: list(model.layers.values()) + mtp_blocks(model),
                             split_stages=split_stages,
                             stage_io=stage_io, apply_tensor_parallel=apply_latent_tensor_parallel,
                             mesh_dims=(EXPERT_PARALLEL,))
