"""Apply a family's parallel plan to a built model, generically: pipeline split, then tensor parallel →
activation checkpointing → compile → FSDP on what each rank keeps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.parallel_dims import ParallelDims
from ..errors import ConfigError
from ..model import ModelSpec, StageShapes, TensorParallelOptions, materialize
from ..numerics import Precision
from ..utils.logging import get_logger
from .activation_checkpoint import checkpoint_and_compile
from .comm import CommCounter
from .fsdp import apply_fsdp, mixed_precision_policy

if TYPE_CHECKING:
    from .pipeline import PipelineParallel

logger = get_logger(__name__)


def parallelize_model(model: nn.Module, spec: ModelSpec, cfg: Any, dims: ParallelDims,
                      device: Optional[torch.device] = None, seed: Optional[int] = None,
                      precision: Optional[Precision] = None, grad_reduce: str = "step"
                      ) -> tuple[nn.Module, Optional[PipelineParallel]]:
    """Parallelize `model` (of family `spec`) in place according to `cfg.parallel` and `dims`.

    A model built on the meta device (`build_model(cfg, "meta")`) is split, sharded and only then
    materialized on `device` and initialized from `seed` (default `cfg.seed`): no rank ever allocates more
    than its shards, and every layout starts from the same weights (model/init.py). Under FSDP, `precision`
    sets its mixed precision policy (16-bit all-gathers, fp32 gradient reduction and master weights);
    `grad_reduce` "micro_batch" makes pipeline stages reduce-scatter every micro-batch's gradients.
    Returns (model, pipeline): `model` is what this rank trains, with the parameter names of the full
    model (under pipeline parallel only this rank's stages); `pipeline` runs the stages (None when
    parallel.pipeline == 1).
    """
    plan = spec.plan
    on_meta = next(model.parameters()).device.type == "meta"
    device = torch.device(device) if device is not None else next(model.parameters()).device
    chunks, stage_ids = [model], [0]
    if dims.pp > 1:
        # imported here: torch.distributed.pipelining brings torch.export (~1 s per process) that only
        # pipeline-parallel runs use
        from .pipeline import split_model
        model, chunks, stage_ids = split_model(model, plan, dims.pp_rank, dims.pp, cfg.model.num_chunks)
        logger.info(f"pipeline rank {dims.pp_rank}/{dims.pp}: stages {stage_ids} of {dims.pp * cfg.model.num_chunks}, "
                    f"{len(plan.blocks(model))} blocks")
    if dims.tp > 1:
        if plan.apply_tensor_parallel is None:
            raise ConfigError(f"parallel.tensor: model_type {spec.name} has no tensor-parallel plan")
        plan.apply_tensor_parallel(model, dims.submesh("tp"), TensorParallelOptions(
            sequence_parallel=cfg.parallel.sequence_parallel, parallel_output=cfg.model.parallel_output,
            local_logits=dims.pp > 1, compile=cfg.model.compile))
    blocks = plan.blocks(model)
    n = checkpoint_and_compile(blocks, cfg.model.checkpoint, cfg.model.compile)
    if n:
        logger.info(f"activation checkpointing on {n} of {len(blocks)} blocks")
    if dims.dp > 1:
        mp = mixed_precision_policy(precision.compute_dtype, precision.reduce_dtype) if precision else None
        apply_fsdp(blocks, chunks, dims, reshard_after_forward=dims.pp == 1, mp_policy=mp)
    if on_meta and device.type != "meta":
        materialize(model, device, cfg.seed if seed is None else seed)
    pipeline = None
    if dims.pp > 1:
        from .pipeline import PipelineParallel
        logits_mesh = dims.submesh("tp") if dims.tp > 1 and cfg.model.parallel_output else None
        pipeline = PipelineParallel(chunks, stage_ids, dims.pp * cfg.model.num_chunks, cfg.data.micro_num,
                                    dims.group("pp"), device, logits_mesh=logits_mesh,
                                    stage_io=_simulated_stage_io(spec, cfg, dims, precision),
                                    reduce_each_micro_batch=grad_reduce == "micro_batch")
    return model, pipeline


def _simulated_stage_io(spec: ModelSpec, cfg: Any, dims: ParallelDims, precision: Optional[Precision]):
    """Under the fake backend (a simulated job) the stages' shapes come from the family's plan, not from peers."""
    if dist.get_backend() != "fake" or spec.plan.stage_io is None:
        return None
    compute = precision.compute_dtype if precision is not None else torch.float32
    # FSDP's mixed precision hands 16-bit activations on; plain autocast keeps the fp32 residual stream
    hidden = compute if dims.dp > 1 else torch.float32
    shapes = StageShapes(rows=cfg.data.micro_bsz, seq_len=cfg.data.seq_len, tp=dims.tp,
                         sequence_parallel=cfg.parallel.sequence_parallel, parallel_output=cfg.model.parallel_output,
                         hidden_dtype=hidden, logits_dtype=compute)
    args = spec.build_args(cfg, "sdpa")
    num_stages = dims.pp * cfg.model.num_chunks
    return lambda stage: spec.plan.stage_io(args, stage, num_stages, shapes)


def __getattr__(name: str):
    if name in ("PipelineParallel", "split_model"):  # lazily, see parallelize_model
        from . import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CommCounter", "PipelineParallel", "apply_fsdp", "mixed_precision_policy", "checkpoint_and_compile", "parallelize_model", "split_model"]
