"""Building blocks for the families' parallel plans: DTensor styles torch lacks, and the pipeline's even split."""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from ..errors import ConfigError


class ReplicateParallel(ParallelStyle):
    """Parameters replicated over the mesh as DTensors; inputs and outputs stay plain (local) tensors.

    For modules that every rank computes in full on the same input (the norms without sequence parallel).
    The gradient of a replicated weight is computed from identical inputs on every rank, so it is
    identical (Replicate) without communication.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, None, input_fn=to_dtensor, output_fn=to_local)


class HeadShardedNorm(ParallelStyle):
    """A norm over the last dim of per-head tensors [B, T, heads, D] whose heads are split over the mesh (q and k
    out of column-parallel projections: Qwen3's q/k norms): the weight replicated, the input taken as Shard(2)
    (its heads), so each rank normalizes its own heads and the weight's gradient is the sum over every rank's
    heads (Partial, as the sequence-parallel norms'); inputs and outputs stay plain tensors."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, (Shard(2),), run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def to_local(mod, outputs, mesh):
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, None, input_fn=to_dtensor, output_fn=to_local)


class VocabParallelEmbedding(RowwiseParallel):
    """An nn.Embedding sharded along the vocabulary (weight `Shard(0)`) that looks up and differentiates only
    each rank's own rows.

    torch's RowwiseParallel computes the forward this way, but DTensor (torch 2.13) has no vocabulary-sharded
    rule for the embedding's backward: every rank computes the gradient of the whole vocabulary (`Replicate`)
    and keeps its slice, tensor-parallel-size times the memory and work of its shard (a full 103168 x 4096
    gradient per rank for 7B). Here each rank maps the token ids into its rows (others masked to zero), so
    its gradient is its own rows (`Shard(0)`), as InternLM's VocabParallelEmbedding1D does; the partial
    outputs are summed into the residual stream's layout (`output_layout`: all-reduce, or reduce-scatter
    along the sequence), returned as a plain tensor. Input: token ids, the same on every rank.
    """

    def __init__(self, output_layout: Placement):
        super().__init__(input_layouts=Replicate(), output_layouts=output_layout)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Embedding or module.padding_idx is not None or module.max_norm is not None:
            raise TypeError(f"VocabParallelEmbedding: expected a plain nn.Embedding, got {module}")
        module = distribute_module(module, device_mesh, self._partition_embedding_fn,
                                   output_fn=partial(_sum_partial_rows, self.output_layouts[0]))
        module.forward = types.MethodType(_own_rows_lookup, module)
        return module


def _own_rows_lookup(module: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    # the weight is the tensor-parallel DTensor here (FSDP, where used, has gathered its own shards)
    weight = module.weight
    rows = weight.to_local()
    start = weight.device_mesh.get_local_rank() * rows.shape[0]  # the config makes tp divide the vocabulary
    outside = (ids < start) | (ids >= start + rows.shape[0])
    out = F.embedding((ids - start).masked_fill(outside, 0), rows)
    return out.masked_fill(outside.unsqueeze(-1), 0.0)


def _sum_partial_rows(layout: Placement, module: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    return DTensor.from_local(out, mesh, (Partial(),), run_check=False).redistribute(placements=(layout,)).to_local()


def stage_layers(num_layers: int, num_stages: int, stage: int) -> list[str]:
    """Names ("0", "1", ...) of the blocks of one virtual pipeline stage: an equal, contiguous run each."""
    if num_layers % num_stages:
        raise ConfigError(f"model.num_layers ({num_layers}) must be divisible by parallel.pipeline * model.num_chunks "
                          f"({num_stages}) to split the layers into pipeline stages")
    per = num_layers // num_stages
    return [str(i) for i in range(stage * per, (stage + 1) * per)]
