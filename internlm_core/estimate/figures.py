"""The estimator's figures: the layout, the memory of one device by what holds it, FSDP's collectives, the estimate."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ..config import Config
from ..config.pipeline import resolve_schedule

GiB = 1024**3
PRECISIONS = ("internlm_core", "internlm")
DEFAULT_PEAK_TFLOPS = 989.0   # H100/H200 SXM dense bf16
DEFAULT_MFU = 0.5


@dataclass
class Layout:
    """How the devices split the work: world = dp * tp * pp; zero1 shards within dp. dims: the sizes of the
    parallel dimensions the family's plan adds (`ParallelPlan.mesh_dims`, by mesh name), carved out of dp_shard.
    cp: context parallel (parallel.context.size). FSDP treats its ranks as data-parallel ones, so `dp` and
    `dp_shard` count them (what FSDP reduces and shards over: dp x cp, dp_shard x cp); `data` is the data-parallel
    size proper (the ranks reading different rows), and each rank holds 1/cp of every sequence's tokens."""

    world_size: int
    tp: int
    pp: int
    dp: int
    dp_shard: int
    num_chunks: int
    sequence_parallel: bool
    dims: dict[str, int] = field(default_factory=dict)
    cp: int = 1
    cp_mode: str = "ring"  # parallel.context.mode / inner
    cp_inner: int = 1
    pipeline_schedule: str = "1f1b"  # config/pipeline.py's resolved name (estimate/pipeline.py simulates it)

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, plan: Any = None) -> "Layout":
        p = cfg.parallel
        cp = p.context.size
        dp = max(world_size // (p.tensor * p.pipeline * cp), 1)
        shard = dp if p.zero1 <= 0 else 1 if p.zero1 == 1 else min(p.zero1, dp)
        return cls(world_size, p.tensor, p.pipeline, dp * cp, shard * cp, cfg.model.num_chunks, p.sequence_parallel,
                   family_dims(cfg, plan, shard), cp=cp, cp_mode=p.context.mode, cp_inner=p.context.inner,
                   pipeline_schedule=resolve_schedule(p.pipeline_schedule, cfg.model.num_chunks))

    @property
    def data(self) -> int:
        """Data-parallel ranks proper: each reads its own rows (context ranks share theirs)."""
        return self.dp // self.cp

    @property
    def sizes(self) -> dict[str, int]:
        """The size of every mesh dimension a count may be divided by (model/counts.py)."""
        return {"tp": self.tp, "sp": self.tp if self.sequence_parallel else 1, "cp": self.cp, **self.dims}

    def describe(self) -> str:
        rep, shard = self.dp // self.dp_shard, self.dp_shard // self.cp
        zero = (f"zero1 shard {shard}" + (f" x replicate {rep}" if rep > 1 else "")) if shard > 1 \
            else "no zero1 sharding"
        own = "".join(f", {name} {size}" for name, size in self.dims.items() if size > 1)
        context = (f", context {self.cp} ({self.cp_mode}{f' inner {self.cp_inner}' if self.cp_mode == '2d' else ''};"
                   f" FSDP shards over {self.dp_shard})") if self.cp > 1 else ""
        return (f"{self.world_size} device(s): data {self.data} ({zero}{own}){context}, tensor {self.tp}"
                f"{' + sequence parallel' if self.sequence_parallel else ''}, pipeline {self.pp}"
                f"{f' x {self.num_chunks} chunks' if self.num_chunks > 1 else ''}"
                f"{f' ({self.pipeline_schedule} schedule)' if self.pp > 1 else ''}")


def family_dims(cfg: Config, plan: Any, dp_shard: int) -> dict[str, int]:
    """{mesh name: size} of the dimensions `plan` adds (`parallel.<key>`, 1 where unset; <= 0: what the
    dimension resolves it to against dp_shard, by default all of it)."""
    requested: Mapping[str, int] = cfg.parallel.dims
    dims = plan.mesh_dims if plan is not None else ()
    return {d.name: int(d.size(int(requested.get(d.key, 1)), dp_shard, cfg.model_inputs())) for d in dims}


# CUDA memory outside the caching allocator (what `torch.cuda.max_memory_reserved` never shows, nvidia-smi does): the
# context with the kernels of torch, cuBLAS and cuDNN loaded lazily (~0.5-0.8 GiB on Hopper with CUDA 12-13), and
# per NCCL communicator its channel buffers (NCCL_BUFFSIZE 4 MiB per direction and channel, up to 32 channels on
# NVLink/InfiniBand, plus the LL/LL128 protocols' buffers): ~0.25 GiB. A run opens one communicator per process group
# it uses with more than one rank. Published defaults, not yet measured here (no GPU: tools/gpu_check.sh prints the
# measured reserved-vs-estimate row where one is lent); 1-3 GiB per GPU in all, as issue 27 reported.
CUDA_CONTEXT_BYTES = 0.75 * 2**30
NCCL_COMMUNICATOR_BYTES = 0.25 * 2**30


def cuda_runtime_bytes(lay: "Layout") -> float:
    """The CUDA context and the NCCL communicators of `lay`'s process groups (every group of more than one rank:
    data / FSDP shard and replicate, tensor, pipeline, and the family's dimensions)."""
    groups = [lay.dp_shard, lay.dp // max(lay.dp_shard, 1), lay.tp, lay.pp, *lay.dims.values()]
    return CUDA_CONTEXT_BYTES + NCCL_COMMUNICATOR_BYTES * sum(1 for g in groups if g > 1)


@dataclass
class Memory:
    """Peak bytes on the busiest device, by what holds them."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    weight_copies: float = 0.0   # 16-bit casts of the weights autocast keeps (saved for backward, or cached)
    fsdp_gathered: float = 0.0   # unsharded parameters / gradients FSDP holds at the peak
    accumulated_gradients: float = 0.0  # unsharded fp32 gradients kept between micro-batches (beyond the shard)
    activations: float = 0.0     # tensors saved for backward (all layers, in-flight micro-batches)
    loss_peak: float = 0.0       # transient buffers of the loss (its backward's logits gradient, fused chunks)
    gemm_copies: float = 0.0     # CPU without native 16-bit GEMM: fp32 operands of the largest linear's backward
    root_reduce: float = 0.0     # FSDP: the end of backward (the root's gradients reduced) above the peak before it
    runtime: float = 0.0         # CPU: the process itself (Python, torch, the data pipeline), as measured
    fp8_casts: float = 0.0       # model.fp8: the float8 operands and scales of the largest converted linear
    stage: str = ""
    host_offload: float = 0.0    # model.offload_activations: host memory the blocks' saved tensors take (not in total)

    ORDER = ("parameters", "gradients", "optimizer", "weight_copies", "fsdp_gathered", "accumulated_gradients",
             "activations", "loss_peak", "gemm_copies", "root_reduce", "runtime", "fp8_casts")
    LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
              "weight_copies": "16-bit weight copies", "fsdp_gathered": "FSDP gathered",
              "accumulated_gradients": "accumulated gradients", "activations": "activations",
              "loss_peak": "loss transients", "gemm_copies": "fp32 GEMM copies (CPU)",
              "root_reduce": "root gradient reduce", "runtime": "process itself (CPU)",
              "fp8_casts": "float8 casts"}

    @property
    def states(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in self.ORDER)


@dataclass
class Communication:
    """FSDP's collectives on one rank (of the stage the memory figures are for) per training step, as
    parallel.CommCounter counts them: the all-gathers' output bytes (unsharded weights in the gathered dtype) and
    the reduce-scatters' input bytes (unsharded fp32 gradients). 0 without sharded data parallel."""

    gathered_bytes: float = 0.0
    reduced_bytes: float = 0.0
    gathers: int = 0
    reduces: int = 0


@dataclass
class Estimate:
    cfg: Config
    layout: Layout
    precision: str
    attention: str
    cross_entropy: str
    grad_reduce: str
    parameters: int
    nonembedding_parameters: int
    model_flops_per_token: float
    hardware_flops_per_token: float
    tokens_per_step: int
    memory: Memory
    mfu: float
    peak_flops: float
    device_memory: Optional[float] = None
    notes: list = field(default_factory=list)
    communication: Communication = field(default_factory=Communication)
    linear: str = "torch"  # numerics' linear kernel: "fp32_gemm" on a CPU without native 16-bit GEMM
    # bytes per step on one rank of the family's own collectives (ModelCounts.block_communication), by term
    model_communication: dict[str, float] = field(default_factory=dict)
    # context parallel: bytes one rank sends per step for attention (model/context's predicted_context_bytes)
    context_bytes: float = 0.0
    # CUDA: the context and NCCL's communicator buffers, outside the caching allocator (not in memory.total)
    device_runtime: float = 0.0
    # what the speed prediction (speed.py) reads: the family's resolved counts, its module args, the per-token
    # bytes, and the busiest stage's layers and recomputed layers
    figures: Any = None
    model_args: Any = None
    token_bytes: Any = None
    stage_layers: int = 0
    checkpointed: int = 0
    # model.fp8 / optimizer.name="muon" (estimate/lowp.py): the block's figures, Muon's all-gather bytes per step
    low_precision: Any = None
    muon_gather_bytes: float = 0.0

    @property
    def step_time(self) -> float:
        return self.tokens_per_step * self.model_flops_per_token / (self.layout.world_size * self.mfu * self.peak_flops)

    @property
    def tokens_per_device_per_second(self) -> float:
        return self.tokens_per_step / self.layout.world_size / self.step_time
