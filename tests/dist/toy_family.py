"""A model family defined entirely here, registered at import: proves that adding a family needs no other file.

The toy is a stack of residual MLP blocks over token embeddings (a causal LM that looks at one token: it
learns bigram statistics). Its spec gives its module, its args from the config, its blocks (activation
checkpointing, FSDP units) and a tensor-parallel plan; nothing else in internlm_core knows it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from internlm_core.errors import ConfigError
from internlm_core.model import (MeshDim, MeshDimContext, ModelSpec, ParallelPlan, get_model_spec, init_parameters,
                                 model_types, register_model)


@dataclass
class ToyArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int


class ToyBlock(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.up = nn.Linear(h, 2 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(F.rms_norm(x, (x.shape[-1],)))))


class ToyLM(nn.Module):
    def __init__(self, a: ToyArgs):
        super().__init__()
        self.embed = nn.Embedding(a.vocab_size, a.hidden_size)
        self.blocks = nn.ModuleList(ToyBlock(a.hidden_size) for _ in range(a.num_layers))
        self.head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    def init_weights(self, seed: int = 0, buffer_device: Optional[torch.device] = None) -> None:
        # the shared helper gives every parameter a layout-independent value (see internlm_core/model/init.py)
        init_parameters(self, seed, lambda name, full, generator: full.normal_(0.0, 0.02, generator=generator))

    def forward(self, input_ids, position_ids=None, cu_seqlens=None, document_ids=None):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        return self.head(F.rms_norm(h, (h.shape[-1],)))


def _tensor_parallel(model: ToyLM, mesh, options) -> None:
    parallelize_module(model, mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(output_layouts=Replicate()),  # logits gathered: a plain tensor
    })
    for block in model.blocks:
        parallelize_module(block, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


TOY = ModelSpec(
    name="TOY_MLP", aliases=("TOYLM",), description="test-only residual MLP language model",
    module=ToyLM,
    build_args=lambda inputs, attn_backend: ToyArgs(inputs.model.vocab_size, inputs.model.hidden_size,
                                                    inputs.model.num_layers),
    plan=ParallelPlan(blocks=lambda m: list(m.blocks), apply_tensor_parallel=_tensor_parallel),
)


# ---- a family with a parallel dimension of its own ------------------------------------------------------------
# TOY_GROUPED is the toy whose embedding rows are sharded over "vg", a mesh dimension that only this family knows
# (`parallel.vocab_groups`), carved out of the data-parallel ranks as expert parallel is: each rank of a group
# reads its own batch, looks up the rows it holds for every token of the group, and gets its own tokens'
# embeddings back summed over the group. Nothing in internlm_core names it.

class _GatherRows(torch.autograd.Function):
    """Forward: every rank's [B, T, h] partial embeddings summed, each rank keeping its own rows (a reduce-scatter
    over the group); backward: the gradients of all ranks' rows gathered (an all-gather)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = partial.new_empty((partial.shape[0] // dist.get_world_size(group), *partial.shape[1:]))
        dist.reduce_scatter_tensor(out, partial.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        full = grad.new_empty((grad.shape[0] * dist.get_world_size(ctx.group), *grad.shape[1:]))
        dist.all_gather_into_tensor(full, grad.contiguous(), group=ctx.group)
        return full, None


class GroupShardedEmbedding(nn.Module):
    """An embedding whose rows are sharded (a DTensor, Shard(0)) over the ranks of one group that read different
    batches: each rank embeds the group's tokens that fall into its rows."""

    def __init__(self, weight: torch.Tensor, mesh) -> None:
        super().__init__()
        self.weight = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
        self.group = mesh.get_group()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = self.weight.to_local()
        rows, rank = local.shape[0], dist.get_rank(self.group)
        everyone = ids.new_empty((ids.shape[0] * dist.get_world_size(self.group), *ids.shape[1:]))
        dist.all_gather_into_tensor(everyone, ids.contiguous(), group=self.group)
        index = everyone - rank * rows
        mine = (index >= 0) & (index < rows)
        partial = F.embedding(index.clamp(0, rows - 1), local) * mine.unsqueeze(-1)
        return _GatherRows.apply(partial, self.group)


def _shard_embedding_rows(model: ToyLM, ctx: MeshDimContext) -> list[nn.Module]:
    if ctx.args.vocab_size % ctx.size:
        raise ConfigError(f"parallel.vocab_groups ({ctx.size}) must divide model.vocab_size ({ctx.args.vocab_size})")
    model.embed = GroupShardedEmbedding(model.embed.weight.detach(), ctx.mesh)
    return [model.embed]


TOY_GROUPED = ModelSpec(
    name="TOY_GROUPED", description="test-only toy LM with its embedding rows sharded over a dimension of its own",
    module=ToyLM,
    build_args=lambda inputs, attn_backend: ToyArgs(inputs.model.vocab_size, inputs.model.hidden_size,
                                                    inputs.model.num_layers),
    plan=ParallelPlan(blocks=lambda m: list(m.blocks), mesh_dims=(
        MeshDim(name="vg", key="vocab_groups", apply=_shard_embedding_rows,
                description="embedding rows sharded over data-parallel ranks"),)),
)


def register() -> ModelSpec:
    """Register the toy families (once per process); returns TOY_MLP's spec."""
    for spec in (TOY, TOY_GROUPED):
        if spec.name not in model_types():
            register_model(spec)
    return get_model_spec("TOY_MLP")


if __name__ == "__main__":  # torchrun driver: python toy_family.py <train.py args>
    register()
    import train
    sys.exit(train.main(sys.argv[1:]))
