"""Apply a family's parallel plan to a built model, generically: pipeline split, then tensor parallel →
activation checkpointing → compile → FSDP on what each rank keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config.pipeline import resolve_schedule
from ..config.schema import Config, ParallelConfig
from ..distributed.parallel_dims import ParallelDims
from ..errors import ConfigError
from ..model import MeshDimContext, ModelInputs, ModelSpec, StageShapes, TensorParallelOptions, materialize
from ..numerics import Precision
from ..utils.logging import get_logger
from .activation_checkpoint import checkpoint_and_compile
from .comm import CommCounter
from .dtype_policy import apply_fp32_units, fsdp_wraps
from .fsdp import apply_fsdp, apply_fsdp_to_dim_modules, mixed_precision_policy
from .offload import check_offload, offload_blocks

if TYPE_CHECKING:
    from .pipeline import PipelineParallel

logger = get_logger(__name__)


@dataclass(frozen=True)
class ParallelOptions:
    """What applying a plan needs besides the layout (ParallelDims): plain values from `model`, `parallel` and
    `data`, so that the parallel code never reads the whole config."""

    inputs: ModelInputs        # the family's view (its args for a simulated pipeline's stage shapes)
    seed: int                  # initial values of a model materialized after sharding
    num_chunks: int = 1        # model.num_chunks: virtual pipeline stages per rank
    pipeline_schedule: str = "auto"  # parallel.pipeline_schedule (config/pipeline.py)
    checkpoint: Any = False    # model.checkpoint: activation checkpointing ("full", "selective", bool or fraction)
    compile: bool = False      # model.compile
    linear_styles: Any = None  # model.fp8 tensorwise: torchao's float8 tensor-parallel styles (parallel/float8.py)
    offload_activations: bool = False  # model.offload_activations (parallel/offload.py)
    sequence_parallel: bool = False
    parallel_output: bool = True
    micro_num: int = 1         # micro-batches per step (the pipeline schedule's)
    micro_bsz: int = 1         # rows of one micro-batch (a simulated pipeline's stage shapes)
    seq_len: int = 2048
    context_mode: str = "ring"  # parallel.context.mode / inner (the size is the layout's, ParallelDims.cp)
    context_inner: int = 1


def parallel_options(cfg: Config) -> ParallelOptions:
    """The ParallelOptions of a config."""
    m = cfg.model
    return ParallelOptions(inputs=cfg.model_inputs(), seed=cfg.seed, num_chunks=m.num_chunks,
                           pipeline_schedule=cfg.parallel.pipeline_schedule, checkpoint=m.checkpoint,
                           compile=m.compile, offload_activations=m.offload_activations,
                           sequence_parallel=cfg.parallel.sequence_parallel, parallel_output=m.parallel_output, micro_num=cfg.data.micro_num,
                           micro_bsz=cfg.data.micro_bsz, seq_len=cfg.data.seq_len,
                           context_mode=cfg.parallel.context.mode, context_inner=cfg.parallel.context.inner)


def family_dims(spec: ModelSpec, parallel: ParallelConfig, world_size: int,
                inputs: Optional[ModelInputs] = None) -> tuple[tuple[str, int], ...]:
    """((mesh name, size), ...) of the dimensions `spec`'s plan adds, from `parallel.dims` (1 where unset; a size
    <= 0 resolved by the dimension against the sharded data-parallel size of `world_size`); ConfigError for a
    size given to a dimension the family does not have."""
    declared = {d.key: d for d in spec.plan.mesh_dims}
    unknown = sorted(set(parallel.dims) - set(declared))
    if unknown:
        raise ConfigError(f"parallel.{unknown[0]}: model_type {spec.name} has no such parallel dimension"
                          + (f" (its own: {', '.join(sorted(declared))})" if declared else ""))
    dp_shard = ParallelDims.from_config(parallel, world_size).dp_shard
    return tuple((d.name, d.size(int(parallel.dims.get(d.key, 1)), dp_shard, inputs))
                 for d in spec.plan.mesh_dims)


def parallelize_model(model: nn.Module, spec: ModelSpec, options: ParallelOptions, dims: ParallelDims,
                      device: Optional[torch.device] = None, seed: Optional[int] = None,
                      precision: Optional[Precision] = None, grad_reduce: str = "step"
                      ) -> tuple[nn.Module, Optional[PipelineParallel]]:
    """Parallelize `model` (of family `spec`) in place as `dims` and `options` say, by the family's plan:
    pipeline split, tensor parallel, the family's own dimensions, activation checkpointing and compile, FSDP.

    A model built on the meta device (`build_model(inputs, "meta")`) is split, sharded and only then
    materialized on `device` and initialized from `seed` (default `options.seed`): no rank ever allocates more
    than its shards, and every layout starts from the same weights (model/init.py). Under FSDP, `precision`
    sets its mixed precision policy (16-bit all-gathers, fp32 gradient reduction and master weights; the
    parameters a module keeps in fp32, the MoE router's gate, in FSDP units of their own: dtype_policy.py);
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
        schedule = resolve_schedule(options.pipeline_schedule, options.num_chunks)
        model, chunks, stage_ids = split_model(model, plan, dims.pp_rank, dims.pp, options.num_chunks, schedule)
        logger.info(f"pipeline rank {dims.pp_rank}/{dims.pp} ({schedule} schedule): stages {stage_ids} of "
                    f"{dims.pp * options.num_chunks}, {len(plan.blocks(model))} blocks")
    if dims.tp > 1:
        if plan.apply_tensor_parallel is None:
            raise ConfigError(f"parallel.tensor: model_type {spec.name} has no tensor-parallel plan")
        plan.apply_tensor_parallel(model, dims.submesh("tp"), TensorParallelOptions(
            sequence_parallel=options.sequence_parallel, parallel_output=options.parallel_output,
            local_logits=dims.pp > 1, compile=options.compile, linear_styles=options.linear_styles))
    dim_modules = apply_family_dims(model, spec, options, dims)
    blocks = plan.blocks(model)
    n = checkpoint_and_compile(blocks, options.checkpoint, options.compile)
    if n:
        logger.info(f"activation checkpointing on {n} of {len(blocks)} blocks")
    if options.offload_activations:
        check_offload(True, dims.tp, dims.pp, options.compile)
        offload_blocks(blocks, device)
        logger.info(f"activation offload to host memory on {len(blocks)} blocks")
    if dims.cp > 1:
        from .context import apply_context_parallel
        apply_context_parallel(model, dims, options.context_mode, options.context_inner, tuple(chunks))
    if fsdp_wraps(dims):
        mp = mixed_precision_policy(precision.compute_dtype, precision.reduce_dtype) if precision else None
        apply_fsdp_to_dim_modules(dim_modules, dims, reshard_after_forward=dims.pp == 1, mp_policy=mp)
        if mp is not None and mp.param_dtype is not None:  # 16-bit gathers: the fp32 gates get units of their own
            apply_fp32_units(blocks, dims, dims.pp == 1, precision.reduce_dtype)
        apply_fsdp(blocks, chunks, dims, reshard_after_forward=dims.pp == 1, mp_policy=mp)
    if on_meta and device.type != "meta":
        materialize(model, device, options.seed if seed is None else seed)
    pipeline = None
    if dims.pp > 1:
        from .pipeline import PipelineParallel
        logits_mesh = dims.submesh("tp") if dims.tp > 1 and options.parallel_output else None
        pipeline = PipelineParallel(chunks, stage_ids, dims.pp * options.num_chunks, options.micro_num,
                                    dims.group("pp"), device, logits_mesh=logits_mesh,
                                    stage_io=_simulated_stage_io(spec, options, dims, precision),
                                    reduce_each_micro_batch=grad_reduce == "micro_batch", schedule=schedule)
    return model, pipeline


def apply_family_dims(model: nn.Module, spec: ModelSpec, options: ParallelOptions, dims: ParallelDims
                      ) -> list[nn.Module]:
    """Each of the family's own dimensions of size > 1 shards what it owns (MeshDim.apply); the modules they
    sharded, for FSDP over the remaining data-parallel ranks."""
    sharded: list[nn.Module] = []
    for dim in spec.plan.mesh_dims:
        size = dims.size(dim.name)
        if size == 1:
            continue
        mesh = dims.submesh(dim.name)
        ctx = MeshDimContext(mesh=mesh, size=size, rank=mesh.get_local_rank(),
                             args=spec.build_args(options.inputs, "sdpa"))
        modules = dim.apply(model, ctx)
        logger.info(f"{dim.name}={size} ({dim.description or dim.key}): {len(modules)} module(s) sharded over it")
        sharded.extend(modules)
    return sharded


def _simulated_stage_io(spec: ModelSpec, options: ParallelOptions, dims: ParallelDims,
                        precision: Optional[Precision]):
    """Under the fake backend (a simulated job) the stages' shapes come from the family's plan, not from peers."""
    if dist.get_backend() != "fake" or spec.plan.stage_io is None:
        return None
    compute = precision.compute_dtype if precision is not None else torch.float32
    # FSDP's mixed precision hands 16-bit activations on; plain autocast keeps the fp32 residual stream
    hidden = compute if dims.dp_cp > 1 else torch.float32
    shapes = StageShapes(rows=options.micro_bsz, seq_len=options.seq_len // dims.cp, tp=dims.tp,  # CP: a chunk
                         sequence_parallel=options.sequence_parallel, parallel_output=options.parallel_output,
                         hidden_dtype=hidden, logits_dtype=compute)
    args = spec.build_args(options.inputs, "sdpa")
    num_stages = dims.pp * options.num_chunks
    return lambda stage: spec.plan.stage_io(args, stage, num_stages, shapes)


def __getattr__(name: str):
    if name in ("PipelineParallel", "split_model"):  # lazily, see parallelize_model
        from . import pipeline
        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CommCounter", "ParallelOptions", "PipelineParallel", "apply_family_dims", "apply_fsdp", "family_dims",
           "fsdp_wraps", "parallel_options", "mixed_precision_policy", "checkpoint_and_compile", "parallelize_model",
           "split_model"]
