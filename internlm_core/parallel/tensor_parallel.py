"""Tensor and sequence parallel as DTensor plans (torch.distributed.tensor.parallel).

Per block (Megatron's layout, InternLM's names): q/k/v and the FFN's w1/w2 column-parallel (each rank
computes its own heads / FFN channels), o and w3 row-parallel (partial sums reduced). The embedding is
vocabulary-parallel (rows sharded, the lookup masked and reduced) and the output column-parallel; with
`model.parallel_output` its logits stay vocabulary-sharded (a DTensor, Shard(-1)) and the loss runs under
`torch.distributed.tensor.parallel.loss_parallel` without gathering them.

With `parallel.sequence_parallel` the residual stream between blocks is sharded along the sequence
(dim 1): norms run on T / tensor tokens per rank, the row-parallel reductions become reduce-scatters and
the inputs of attention / FFN all-gathers. Without it the norms' weights are still DTensors (replicated),
so that every parameter of a tensor-parallel model lives on one mesh (the optimizer's foreach kernels,
FSDP's 2-D sharding and the global gradient norm rely on that).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle


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


def _norm_style(sequence_parallel: bool) -> ParallelStyle:
    # use_local_output: the residual stream stays a plain tensor (the local sequence shard under SP)
    return SequenceParallel(use_local_output=True) if sequence_parallel else ReplicateParallel()


def block_plan(sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan of one TransformerBlock (keys are module paths inside the block)."""
    stream = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    return {
        "attention_norm": _norm_style(sequence_parallel),
        # (x, cos, sin, meta): gather x once for q, k and v (one all-reduce of its gradient, not three)
        "attention": PrepareModuleInput(input_layouts=(stream, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=stream),
        "ffn_norm": _norm_style(sequence_parallel),
        "feed_forward": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": ColwiseParallel(),
        "feed_forward.w3": RowwiseParallel(output_layouts=stream),
    }


def root_plan(model: nn.Module, sequence_parallel: bool, parallel_output: bool,
              local_logits: bool = False) -> dict[str, ParallelStyle]:
    """Embedding, final norm and output, for those this (pipeline stage's) model has.

    local_logits: with parallel_output, return this rank's vocabulary shard as a plain tensor instead of
    a DTensor (a pipeline stage's output must be a plain tensor; the pipeline's loss wraps it again)."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.norm is not None:
        plan["norm"] = _norm_style(sequence_parallel)
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=stream,
                                         output_layouts=Shard(-1) if parallel_output else Replicate(),
                                         use_local_output=local_logits or not parallel_output)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                          parallel_output: bool, local_logits: bool = False) -> nn.Module:
    """Shard `model` (a Transformer, possibly one pipeline stage's part of it) over `tp_mesh`, in place."""
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    parallelize_module(model, tp_mesh, root_plan(model, sequence_parallel, parallel_output, local_logits))
    if tied:  # both are sharded along the vocabulary (Shard(0)): share the one DTensor again
        model.output.weight = model.tok_embeddings.weight
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, block_plan(sequence_parallel))
    return model

