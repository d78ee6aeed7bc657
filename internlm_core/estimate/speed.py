"""The predicted step time and MFU of an estimate on a GPU of gpus.py's table, term by term.

Per training step on one GPU of the busiest pipeline stage (the last: its blocks and the head), T = micro_bsz *
seq_len / cp tokens per micro-batch, M micro-batches, layers = L / pp blocks, of which R are recomputed:

  GEMM              3 * 2 * (the block's dense weights / tp * layers + the output layer's / tp) * T * M
                    / (peak * gemm)                                                     (forward + 2x backward)
  expert GEMM       3 * (a block's expert FLOPs per token: its forward FLOPs at seq_len 0 less 2 per dense
                    weight) / tp * layers * T * M / (peak * expert_grouped or expert_loop)
  attention         forward: A * f * layers * T * M / (peak * fwd), backward 2.5x the forward's FLOPs at bwd's
                    efficiency; A = the family's attention FLOPs per token (forward FLOPs at seq_len less at 0:
                    4 * heads * head_dim * keys), f = 1/2 for the kernels that skip the masked half (flash-attn,
                    torch's varlen, SDPA's causal kernel without a mask; packed documents skip more, not counted),
                    f = 1 for SDPA with a dense document mask (every block computed). Context parallel on the
                    blockwise torch core (attention sdpa or cpu_blocked): memory-bound, 50 bytes of HBM traffic per
                    score element forward and 85 backward (issue 34's count), score elements = A / (4 * head_dim) / 2.
  recompute         R / layers of the forward parts above (GEMM, expert GEMM, attention) once more
  memory-bound ops  4 passes (written and read forward, read and its gradient written backward) over the bytes a
                    block keeps for backward, the head's and the shared ones, at hbm * HBM bandwidth (a proxy for
                    norms, rotary, SwiGLU, residual adds, the loss; 2 passes under model.compile, which fuses
                    them), + 2 more passes over a recomputed block's
  optimizer step    32 bytes per parameter of the local shard (AdamW reads parameter, gradient, two moments and
                    writes three; the norm reads the gradient) at hbm * HBM bandwidth
  pipeline bubble   (pp - 1) / (chunks * M) of the compute above (1F1B)
  exposed FSDP all-gather / reduce-scatter   the collectives' sizes * (n-1)/n over the link of the shard group,
                    overlapped with the compute by prefetch except one gather per micro-batch and the step's last
                    reduce-scatter; what does not fit under the compute is exposed too
  TP/SP collectives 8 per block and micro-batch (2 all-gathers + 2 reduce-scatters or 2 all-reduces, forward and
                    backward; 4 more for a recomputed block) of T * hidden * dtype bytes * (tp-1)/tp, not overlapped
  context exchange  model/context's bytes per step over the context group's link: ring overlaps the attention
                    (what exceeds it is exposed), all_to_all and 2d are exposed whole (forward repeats under
                    recomputation are not counted)
  expert all-to-all the family's bytes per step over the expert group's link, not overlapped

A group runs on NVLink when the ranks it spans (mesh order pp, dp_replicate, dp_shard, [ep], cp, tp: a group
spans its size times the dimensions inside it) fit one node (8 GPUs), else on the network (one NIC per GPU), at
link * bandwidth. Step time = the sum; MFU = model FLOPs (the trainer's 6N + 12*L*h*s per token) / (GPUs * peak
* step time). Not counted: kernel launch gaps, the data loader, the pipeline's point-to-point sends, logging
steps, stragglers. Every efficiency is an assumption until tools/gpu_check.sh measures it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..config import Config
from ..errors import ConfigError
from ..numerics.kernels import EXPERT_GEMM, select_attention
from ..numerics.precision import resolve_precision
from ..utils.accelerators import NOT_INSTALLED, WORKING
from .figures import Estimate
from .gpus import EFFICIENCY, GpuSpec
from .lowp import fp8_flops_per_token, low_precision_terms
from .pipeline import profile
from .terms import divisor

ATTENTION_BACKWARD_FLOPS = 2.5   # FA2's backward: five matmuls against the forward's two
BLOCKWISE_BYTES = (50.0, 85.0)   # HBM bytes per score element of the blockwise core, forward and backward
ELEMENTWISE_PASSES = 4
COMPILED_PASSES = 2           # model.compile fuses the elementwise chains (an assumption: half the traffic)
OPTIMIZER_BYTES = 32
FLASH_KERNELS = ("flash", "torch_varlen")
COMPUTE = ("GEMM", "expert GEMM", "attention", "recompute", "memory-bound ops", "optimizer step")


@dataclass(frozen=True)
class SpeedKernels:
    """The kernel classes the prediction prices: attention (flash, torch_varlen, sdpa, cpu_blocked), the context-
    parallel core (flash: the varlen kernels, blockwise: the torch core; none without context parallel) and the
    experts' GEMMs (grouped, loop; none for dense models)."""

    attention: str
    context: str
    expert_gemm: str


@dataclass
class Prediction:
    """Seconds per step by term (in COMPUTE order, then the bubble and the exposed communication)."""

    gpu: GpuSpec
    kernels: SpeedKernels
    terms: dict[str, float]
    tokens_per_step: int
    world_size: int
    model_flops_per_token: float
    notes: list[str] = field(default_factory=list)

    @property
    def step_time(self) -> float:
        return sum(self.terms.values())

    @property
    def tokens_per_gpu_per_second(self) -> float:
        return self.tokens_per_step / self.world_size / self.step_time

    @property
    def mfu(self) -> float:
        return self.tokens_per_gpu_per_second * self.model_flops_per_token / (self.gpu.peak_tflops * 1e12)

    def bound_by(self, top: int = 4) -> str:
        """The largest terms as shares of the step, e.g. "GEMM 61%, attention 22%, exposed FSDP all-gather 9%"."""
        ranked = sorted(((v, k) for k, v in self.terms.items() if v > 0), reverse=True)[:top]
        return ", ".join(f"{k} {v / self.step_time:.0%}" for v, k in ranked)


def default_attention(cfg: Config, flash_attn: bool = True, torch_varlen: bool = True) -> str:
    """The attention numerics/kernels.py chooses on a GPU for `cfg`: flash-attn installed and working or not
    (`flash_attn`), torch's varlen kernel there or not (`torch_varlen`: torch >= 2.11 on sm80+, every supported
    torch; False: an older build without it)."""
    m = cfg.model
    return select_attention(m.attn_backend, m.use_flash_attn, resolve_precision(m.dtype, "cuda"), "cuda",
                            WORKING if flash_attn else NOT_INSTALLED, [], {},
                            WORKING if torch_varlen else NOT_INSTALLED)


def default_kernels(e: Estimate, gpu: GpuSpec, expert_gemm: Optional[str] = None) -> SpeedKernels:
    """The estimate's attention kernel (estimate(attention=...), default_attention's by default); the context-
    parallel core follows it (model/context: flash-attn's and torch's varlen kernels, else the blockwise core);
    the experts' grouped GEMM on Hopper (torch._grouped_mm's bf16 kernel), the per-expert loop elsewhere (an
    assumption: numerics probes it on the device), unless `expert_gemm` is given."""
    context = "none" if e.layout.cp == 1 else "flash" if e.attention in FLASH_KERNELS else "blockwise"
    moe = any(d not in ("tp", "sp") for w in e.figures.block.linears for d in w.shard)
    if expert_gemm is None:
        expert_gemm = "grouped" if gpu.arch == "hopper" else "loop"
    elif expert_gemm not in EXPERT_GEMM:
        raise ConfigError(f"--expert-gemm {expert_gemm}: expected one of {', '.join(EXPERT_GEMM)}")
    return SpeedKernels(e.attention, context, expert_gemm if moe else "none")


def _flops_per_token(e: Estimate) -> tuple[float, float, float, float]:
    """(dense block GEMM, expert GEMM, attention, head GEMM) forward FLOPs per token on one device."""
    fig, args, s = e.figures, e.model_args, e.layout.sizes
    expert = [w for w in fig.block.linears if any(d not in ("tp", "sp") for d in w.shard)]
    dense = [w for w in fig.block.linears if w not in expert]
    no_attention = fig.counts.block_flops_per_token(args, 0)
    attention = fig.counts.block_flops_per_token(args, e.cfg.data.seq_len) - no_attention
    expert_fwd = no_attention - 2 * sum(w.elements for w in dense)
    tp = e.layout.tp
    return (2 * sum(w.elements / divisor(w.shard, s) for w in dense),
            expert_fwd / (tp if any("tp" in w.shard for w in expert) else 1), attention / tp,
            2 * sum(w.elements / divisor(w.shard, s) for w in fig.head.linears))


def _attention_seconds(e: Estimate, gpu: GpuSpec, k: SpeedKernels, fwd_flops: float) -> tuple[float, float]:
    """(forward, backward) seconds of the attention of `fwd_flops` model forward FLOPs (full rows)."""
    eff, peak = EFFICIENCY[gpu.arch], gpu.peak_tflops * 1e12
    if k.context == "blockwise":
        m = e.cfg.model
        head_dim = m.head_dim or m.hidden_size // m.num_attention_heads
        scores = fwd_flops / (4 * head_dim) / 2
        bw = gpu.hbm_gbs * 1e9 * eff["hbm"]
        return scores * BLOCKWISE_BYTES[0] / bw, scores * BLOCKWISE_BYTES[1] / bw
    masked = k.attention in ("sdpa", "cpu_blocked") and not e.cfg.data.pack_sample_into_one and k.context == "none"
    work, cls = (fwd_flops, "sdpa_mask") if masked else (fwd_flops / 2, "flash")
    return work / (peak * eff[f"{cls}_fwd"]), ATTENTION_BACKWARD_FLOPS * work / (peak * eff[f"{cls}_bwd"])


def compute_terms(e: Estimate, gpu: GpuSpec, k: SpeedKernels) -> dict[str, float]:
    """Seconds per step of the COMPUTE terms on one device of the busiest stage."""
    eff, peak, d = EFFICIENCY[gpu.arch], gpu.peak_tflops * 1e12, e.cfg.data
    tokens = d.micro_bsz * d.seq_len // e.layout.cp * d.micro_num
    layers, recomputed = e.stage_layers, e.checkpointed
    dense, expert, attn, head = _flops_per_token(e)
    expert_eff = eff["expert_grouped" if k.expert_gemm == "grouped" else "expert_loop"]
    converted = fp8_flops_per_token(e, gpu)  # model.fp8: the converted dense GEMMs, at the float8 rate
    gemm_fwd = tokens * layers * ((dense - converted) / (peak * eff["gemm"])
                                  + converted / (gpu.fp8_tflops * 1e12 * eff["gemm"] or 1.0))
    expert_fwd = tokens * layers * expert / (peak * expert_eff)
    attn_fwd, attn_bwd = (tokens * layers * t for t in _attention_seconds(e, gpu, k, attn))
    hbm = gpu.hbm_gbs * 1e9 * eff["hbm"]
    tb = e.token_bytes
    passes = COMPILED_PASSES if e.cfg.model.compile else ELEMENTWISE_PASSES
    elementwise = tokens * (passes * (layers * tb.block + tb.head + tb.shared)
                            + 2 * recomputed * tb.block) / hbm
    return {"GEMM": 3 * gemm_fwd + 3 * tokens * head / (peak * eff["gemm"]), "expert GEMM": 3 * expert_fwd,
            "attention": attn_fwd + attn_bwd,
            "recompute": recomputed / max(layers, 1) * (gemm_fwd + expert_fwd + attn_fwd),
            "memory-bound ops": elementwise,
            "optimizer step": e.memory.optimizer / 8 * OPTIMIZER_BYTES / hbm}


def _link(gpu: GpuSpec, span: int) -> float:
    """Bytes per second a rank sends in a collective over `span` consecutive ranks (NVLink inside a node)."""
    return 1e9 * EFFICIENCY[gpu.arch]["link"] * (gpu.nvlink_gbs if span <= gpu.node_gpus else gpu.network_gbs)


def communication_terms(e: Estimate, gpu: GpuSpec, k: SpeedKernels, compute: float, attention: float
                        ) -> dict[str, float]:
    """Seconds per step of the communication left exposed (module docstring)."""
    lay, d, comm = e.layout, e.cfg.data, e.communication
    family = 1  # the family's dimensions (expert parallel) sit between dp_shard and cp in the mesh
    for size in lay.dims.values():
        family *= size
    out = {}
    if comm.gathers:
        n = lay.dp_shard
        bw = _link(gpu, n * lay.tp)
        ag = comm.gathered_bytes * (n - 1) / n / bw
        rs = comm.reduced_bytes * (n - 1) / n / bw
        overflow = max(0.0, ag + rs - compute)
        share = ag / (ag + rs) if ag + rs else 0.0
        out["exposed FSDP all-gather"] = ag * d.micro_num / comm.gathers + overflow * share
        out["exposed FSDP reduce-scatter"] = rs / comm.reduces + overflow * (1 - share)
    if lay.tp > 1:
        passes = 8 * e.stage_layers + 4 * e.checkpointed
        comp = resolve_precision(e.cfg.model.dtype, "cuda").compute_dtype.itemsize
        sent = passes * d.micro_num * d.micro_bsz * d.seq_len // lay.cp * e.cfg.model.hidden_size * comp
        out["TP/SP collectives"] = sent * (lay.tp - 1) / lay.tp / _link(gpu, lay.tp)
    if e.context_bytes:
        t = e.context_bytes / _link(gpu, lay.cp * lay.tp)
        out["context exchange"] = max(0.0, t - attention) if lay.cp_mode == "ring" else t
    a2a = e.model_communication.get("expert all-to-all", 0.0)
    if a2a:
        out["expert all-to-all"] = a2a / _link(gpu, family * lay.cp * lay.tp)
    return out


def predict(e: Estimate, gpu: GpuSpec, kernels: Optional[SpeedKernels] = None) -> Prediction:
    """The step time, tokens/s per GPU and MFU `e` (an estimate(device="cuda")) should reach on `gpu`."""
    k = kernels or default_kernels(e, gpu)
    terms = compute_terms(e, gpu, k)
    compute = sum(terms.values())
    lay = e.layout
    # the schedule's own action lists simulated with unit F / B / I / W times (estimate/pipeline.py)
    terms["pipeline bubble"] = compute * (profile(lay.pipeline_schedule, lay.pp, lay.num_chunks,
                                                  e.cfg.data.micro_num).bubble_ratio if lay.pp > 1 else 0.0)
    terms.update(communication_terms(e, gpu, k, compute, terms["attention"]))
    terms.update(low_precision_terms(e, gpu))  # model.fp8's casts, Muon's gathers and Newton-Schulz
    notes = [f"kernels: attention {k.attention}"
             + (f", context-parallel core {k.context}" if k.context != "none" else "")
             + (f", expert GEMMs {k.expert_gemm}" if k.expert_gemm != "none" else ""),
             "efficiencies are assumptions (estimate/gpus.py) until tools/gpu_check.sh measures them"]
    return Prediction(gpu, k, terms, e.tokens_per_step, lay.world_size, e.model_flops_per_token, notes)


def format_prediction(p: Prediction) -> str:
    """The lines tools/estimate.py prints after the estimate."""
    lines = [f"predicted on {p.gpu.name} ({p.gpu.peak_tflops:g} TFLOP/s bf16, HBM {p.gpu.hbm_gbs / 1e3:g} TB/s): "
             f"step {p.step_time:.3f} s, {p.tokens_per_gpu_per_second:,.0f} tokens/s per GPU, MFU {p.mfu:.1%}",
             f"  bound by: {p.bound_by()}"]
    lines += [f"  {name:<28} {t * 1e3:10.1f} ms  {t / p.step_time:5.1%}" for name, t in p.terms.items() if t > 0]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)
