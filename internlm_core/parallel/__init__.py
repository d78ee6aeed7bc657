"""Apply parallelism to a built model: pipeline split, then tensor parallel → activation checkpointing →
compile → FSDP on what each rank keeps."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from ..config import Config
from ..distributed.parallel_dims import ParallelDims
from ..model import apply_activation_checkpointing
from ..utils.logging import get_logger
from .fsdp import apply_fsdp
from .pipeline import PipelineParallel, split_model, stage_layers
from .tensor_parallel import ReplicateParallel, apply_tensor_parallel

logger = get_logger(__name__)


def _copy_output(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
    # torch 2.13: when the vocabulary-parallel embedding's output (a view made by DTensor.to_local) is the
    # input of a compiled block, backward fails ("'Tensor' object has no attribute '_local_tensor'");
    # a copy of it (one [B, T, hidden] activation) does not
    return output.clone()


def parallelize_model(model: nn.Module, cfg: Config, dims: ParallelDims, device: Optional[torch.device] = None
                      ) -> tuple[nn.Module, Optional[PipelineParallel]]:
    """Parallelize `model` in place according to `cfg.parallel` and `dims`.

    Returns (model, pipeline): `model` is what this rank trains, with the parameter names of the full
    model (under pipeline parallel only this rank's stages); `pipeline` runs the stages (None when
    parallel.pipeline == 1).
    """
    device = device or next(model.parameters()).device
    chunks, stage_ids = [model], [0]
    if dims.pp > 1:
        model, chunks, stage_ids = split_model(model, dims.pp_rank, dims.pp, cfg.model.num_chunks)
        logger.info(f"pipeline rank {dims.pp_rank}/{dims.pp}: stages {stage_ids} of {dims.pp * cfg.model.num_chunks}, "
                    f"layers {list(model.layers.keys())}")
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.submesh("tp"), cfg.parallel.sequence_parallel, cfg.model.parallel_output,
                              local_logits=dims.pp > 1)
    n = apply_activation_checkpointing(model, cfg.model.checkpoint)
    if n:
        logger.info(f"activation checkpointing on {n} of {len(model.layers)} layers")
    if cfg.model.compile:
        if dims.tp > 1 and model.tok_embeddings is not None:
            model.tok_embeddings.register_forward_hook(_copy_output)
        for layer in model.layers.values():
            if layer.use_checkpoint:  # compile inside the recomputed function, not checkpointing inside a graph
                layer._forward = torch.compile(layer._forward)
            else:
                layer.compile()
    if dims.dp > 1:
        apply_fsdp(model, dims, roots=chunks, reshard_after_forward=dims.pp == 1)
    pipeline = None
    if dims.pp > 1:
        logits_mesh = dims.submesh("tp") if dims.tp > 1 and cfg.model.parallel_output else None
        pipeline = PipelineParallel(chunks, stage_ids, dims.pp * cfg.model.num_chunks, cfg.data.micro_num,
                                    dims.group("pp"), device, logits_mesh=logits_mesh)
    return model, pipeline


__all__ = ["PipelineParallel", "ReplicateParallel", "apply_fsdp", "apply_tensor_parallel", "parallelize_model",
           "split_model", "stage_layers"]
