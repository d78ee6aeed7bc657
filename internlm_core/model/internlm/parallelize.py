"""The InternLM transformer's parallel plan: tensor/sequence parallel as DTensor plans, pipeline stage split.

Tensor parallel per block (Megatron's layout, InternLM's names): q/k/v and the FFN's w1/w2 column-parallel
(each rank computes its own heads / FFN channels), o and w3 row-parallel (partial sums reduced). The embedding
is vocabulary-parallel (rows sharded, the lookup masked and reduced, each rank differentiating its own rows:
parallel_styles.VocabParallelEmbedding) and the output column-parallel; with
`model.parallel_output` its logits stay vocabulary-sharded (a DTensor, Shard(-1)) and the loss runs under
`torch.distributed.tensor.parallel.loss_parallel` without gathering them.

With sequence parallel the residual stream between blocks is sharded along the sequence (dim 1): norms run
on T / tensor tokens per rank, the row-parallel reductions become reduce-scatters and the inputs of attention /
FFN all-gathers. Without it the norms' weights are still DTensors (replicated), so that every parameter of a
tensor-parallel model lives on one mesh (the optimizer's foreach kernels, FSDP's 2-D sharding and the global
gradient norm rely on that).

Pipeline: `parallel.pipeline * model.num_chunks` virtual stages each get an equal, contiguous run of blocks;
stage 0 also holds the embedding, the last stage the final norm and the output.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.distributed.tensor.parallel.style import ParallelStyle

from ...errors import ConfigError
from ..mtp import mtp_blocks
from ..parallel_styles import HeadShardedNorm, ReplicateParallel, VocabParallelEmbedding, stage_layers
from ..spec import ParallelPlan, StageShapes, TensorParallelOptions


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
        plan["tok_embeddings"] = VocabParallelEmbedding(stream)
    if model.norm is not None:
        plan["norm"] = _norm_style(sequence_parallel)
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=stream,
                                         output_layouts=Shard(-1) if parallel_output else Replicate(),
                                         use_local_output=local_logits or not parallel_output)
    return plan


def _copy_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    # torch 2.13: when the vocabulary-parallel embedding's output (a view made by DTensor.to_local) is the
    # input of a compiled block, backward fails ("'Tensor' object has no attribute '_local_tensor'");
    # a copy of it (one [B, T, hidden] activation) does not
    return output.clone()


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, options: TensorParallelOptions,
                          layer_plan: Optional[Callable[[nn.Module, bool], dict[str, ParallelStyle]]] = None) -> None:
    """Shard `model` (a Transformer, possibly one pipeline stage's part of it) over `tp_mesh`, in place.
    layer_plan(block, sequence_parallel): a block's plan when not every block is dense (a MoE family's)."""
    tied = (model.tok_embeddings is not None and model.output is not None
            and model.output.weight is model.tok_embeddings.weight)
    parallelize_module(model, tp_mesh, root_plan(model, options.sequence_parallel, options.parallel_output,
                                                 options.local_logits))
    if tied:  # both are sharded along the vocabulary (Shard(0)): share the one DTensor again
        model.output.weight = model.tok_embeddings.weight
    for layer in model.layers.values():
        plan = layer_plan(layer, options.sequence_parallel) if layer_plan else block_plan(options.sequence_parallel)
        if getattr(layer.attention, "q_norm", None) is not None:  # model.qk_norm: each rank normalizes its heads
            plan = {**plan, "attention.q_norm": HeadShardedNorm(), "attention.k_norm": HeadShardedNorm()}
        if options.linear_styles is not None:  # model.fp8: float8 tensor-parallel styles (parallel/float8.py)
            plan = options.linear_styles(layer, plan)
        parallelize_module(layer, tp_mesh, plan)
    if options.compile and model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(_copy_output)


def split_stages(model: nn.Module, stage_ids: list[int], num_stages: int) -> tuple[nn.Module, list[nn.Module]]:
    """Prune `model` to the virtual stages `stage_ids`; returns (model, one chunk per stage).

    `model` keeps the parameter names of the full model (layers keyed by their global index), so the
    optimizer, clipping and checkpoints see one module per rank. Each chunk runs one virtual stage and
    shares its modules with `model` (it *is* `model` when there is one stage per rank).
    """
    if num_stages > 1 and model.output is not None and model.tok_embeddings is not None \
            and model.output.weight is model.tok_embeddings.weight:
        raise ConfigError("model.tie_word_embeddings: not supported with parallel.pipeline > 1 "
                          "(the embedding and the output live on different stages)")
    owned = {name: s for s in stage_ids for name in stage_layers(len(model.layers), num_stages, s)}
    for name in list(model.layers.keys()):
        if name not in owned:
            del model.layers[name]
    if 0 not in stage_ids:
        model.tok_embeddings = None
    if num_stages - 1 not in stage_ids:
        model.norm = None
        model.output = None
        model.mtp = None  # model.mtp's depths run on the last stage (their embeddings come with the hidden states)
    if len(stage_ids) == 1:
        return model, [model]
    return model, [_chunk_view(model, s, num_stages, [n for n, t in owned.items() if t == s]) for s in stage_ids]


def _chunk_view(model: nn.Module, stage: int, num_stages: int, layer_names: list[str]) -> nn.Module:
    """A Transformer of the same class running one virtual stage with `model`'s own submodules."""
    chunk = type(model).__new__(type(model))
    nn.Module.__init__(chunk)  # fresh hooks and registries (FSDP installs its own on each chunk)
    chunk.args = model.args
    chunk.tok_embeddings = model.tok_embeddings if stage == 0 else None
    chunk.layers = nn.ModuleDict({name: model.layers[name] for name in layer_names})
    last = stage == num_stages - 1
    chunk.norm = model.norm if last else None
    chunk.output = model.output if last else None
    chunk.mtp = model.mtp if last else None
    chunk.rope = model.rope  # shared: materializing the model materializes the chunks' tables too
    chunk.context = model.context  # None: the pipeline refuses context parallel (config/rules.py)
    return chunk


def stage_io(args: Any, stage: int, num_stages: int, sh: StageShapes) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch in and out of a stage: token ids into the first, hidden states [rows, T (/ tp under
    sequence parallel), hidden] between stages, logits [rows, T, V (/ tp with parallel_output)] out of the last."""
    tokens = sh.seq_len // sh.tp if sh.sequence_parallel else sh.seq_len
    width = args.hidden_size * (1 + args.mtp_depth)  # model.mtp: the depths' embeddings travel with h (model/mtp.py)
    hidden = torch.empty(sh.rows, tokens, width, dtype=sh.hidden_dtype, device="meta")
    x = torch.empty(sh.rows, sh.seq_len, dtype=torch.long, device="meta") if stage == 0 else hidden
    if stage < num_stages - 1:
        return x, hidden
    vocab = args.vocab_size // sh.tp if sh.parallel_output and sh.tp > 1 else args.vocab_size
    return x, torch.empty(sh.rows, sh.seq_len, vocab, dtype=sh.logits_dtype, device="meta")


PLAN = ParallelPlan(blocks=lambda model: list(model.layers.values()) + mtp_blocks(model),
                    apply_tensor_parallel=apply_tensor_parallel, split_stages=split_stages, stage_io=stage_io)
