"""What `model.fp8` and `optimizer.name="muon"` change in the estimate (internlm_core's precision accounting).

float8 / MXFP8 linears (config/fp8.py's rule picks them among the family's block linears; the head never):
  - no autocast 16-bit copy of a converted weight: torchao casts the fp32 (or FSDP-gathered) weight straight to
    float8 in each forward and backward and keeps the high-precision weight for backward (its saved tensors are
    the input and the weight, as a plain linear's), so `weight_copies` counts only the other matrices;
  - `float8 casts`: the transient float8 operands of the largest converted linear's backward: its weight and the
    weight's transpose (1 byte each per element), the input and the output gradient of one micro-batch in both
    layouts (1 byte per element each), and their scales (tensorwise: a few floats; rowwise: 4 bytes per row of each
    operand; MXFP8: 1 byte per 32 values);
  - the float8 all-gather (tensorwise, `enable_fsdp_float8_all_gather`): FSDP gathers the converted weights in 1
    byte instead of the gathered dtype (4 fp32, 2 bf16): FSDP's gathered buffers and all-gather bytes shrink by
    that share (the reduce-scatters stay fp32);
  - speed (speed.py): the converted GEMMs run at the GPU's float8 rate (`GpuSpec.fp8_tflops`, 2x bf16 on H100 /
    H200) at the same efficiency, plus the casts as memory-bound traffic: per token and converted linear, the input
    (in) and output gradient (out) read twice (amax, then cast) and written once in float8, in both layouts
    (2 (in + out) (2 c + 1) bytes, c the compute dtype's size).
Muon (optim/muon.py): the hidden matrices (model/roles.py: >= 2-D weights in the blocks, not the routers) keep one
  fp32 momentum buffer (4 bytes per element) instead of AdamW's two moments (8); each dense matrix cut by FSDP or
  tensor parallel is gathered whole every step (`full_tensor` of its fp32 update: 4 bytes per element of the whole
  matrix, on every rank of its mesh), and every rank runs the Newton-Schulz iteration on each whole matrix of its
  stage (5 steps of X X^T, A A, (bA + cA^2) X on the wide orientation: 5 (4 m^2 n + 2 m^3) FLOPs for m <= n).
  Experts (3-D, sharded by expert) are orthogonalized where they live: no gather, each rank its own experts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from ..config.fp8 import Fp8Plan, fp8_plan, linear_skip_reason
from ..errors import ConfigError
from ..model.counts import Linear
from ..numerics.precision import resolve_precision
from .figures import Layout
from .terms import divisor, fsdp_share, matrices, scaled

NS_STEPS = 5


@dataclass(frozen=True)
class LowPrecision:
    """The fp8 and Muon figures of one block (elements on one device unless a name says global)."""

    fp8: Optional[Fp8Plan] = None
    muon: bool = False
    converted_local: float = 0.0     # elements of a block's converted matrices on one device (before FSDP)
    converted_flops: float = 0.0     # forward FLOPs per token of those matrices on one device (dense ones)
    cast_elements: float = 0.0       # per token: in + out of every converted dense linear (one device)
    largest: tuple[float, float] = (0.0, 0.0)  # (out, in) of the largest converted linear on one device
    hidden_terms: tuple = ()         # a block's Muon matrices as parameter Terms (global, with their shard dims)
    gathered_global: float = 0.0     # elements of a block's dense Muon matrices gathered whole (cut ones)
    ns_flops: float = 0.0            # Newton-Schulz FLOPs of one block's matrices on one rank

    @property
    def float8_gather(self) -> bool:
        return self.fp8 is not None and self.fp8.fsdp_float8_all_gather


def is_expert(w: Linear) -> bool:
    """A linear of stacked experts (a shard dimension other than tensor / sequence parallel)."""
    return any(d not in ("tp", "sp") for d in w.shard)


def _ns_flops(rows: float, cols: float) -> float:
    m, n = min(rows, cols), max(rows, cols)
    return NS_STEPS * (4 * m * m * n + 2 * m ** 3)


def low_precision(cfg: Any, linears: tuple[Linear, ...], lay: Layout) -> LowPrecision:
    """The LowPrecision of a config (model.fp8, optimizer.name) over a block's `linears` (the family's counts)."""
    plan, muon = fp8_plan(cfg.model.fp8), cfg.optimizer.name == "muon"
    converted = flops = casts = 0.0
    largest = (0.0, 0.0)
    for w in linears if plan is not None else ():
        if is_expert(w) and not plan.mx:
            continue  # torchao's Float8Linear swaps linears only; the experts are 3-D parameters
        if linear_skip_reason(w.name, w.in_features, w.out_features, plan) is None:
            out, inp = w.local_shape(divisor(w.shard, lay.sizes))
            converted += out * inp
            if not is_expert(w):
                flops, casts = flops + 2 * out * inp, casts + out + inp
            largest = max(largest, (out, inp), key=lambda s: s[0] * s[1])
    hidden = [w for w in linears if w.own and w.name.rsplit(".", 1)[-1] not in ("gate", "router")] if muon else []
    cut = lay.dp_shard > 1 or lay.tp > 1
    dense = [w for w in hidden if not is_expert(w)]
    ns = sum(_ns_flops(w.out_features, w.in_features) for w in dense)
    ns += sum(_ns_flops(w.out_features, w.in_features) / divisor(w.shard, lay.sizes) for w in hidden if is_expert(w))
    return LowPrecision(plan, muon, converted, flops, casts, largest, tuple(matrices(hidden)),
                        sum(w.elements for w in dense) if cut else 0.0, ns)


def fp8_casts(lp: LowPrecision, tokens: int, comp: int) -> float:
    """The transient float8 operands (and scales) of the largest converted linear's backward (module docstring)."""
    if lp.fp8 is None or not lp.converted_local:
        return 0.0
    out, inp = lp.largest
    operands = 2 * out * inp + 2 * tokens * (inp + out)
    scales = (2 * out * inp + 2 * tokens * (inp + out)) / 32 if lp.fp8.mx else \
        4 * 2 * (tokens + out) if lp.fp8.recipe != "tensorwise" else 16.0
    return float(operands + scales)


def gathered_saving(lp: LowPrecision, itemsize: int) -> float:
    """Bytes the float8 all-gather saves per gathered block (its converted weights in 1 byte)."""
    return (itemsize - 1) * lp.converted_local if lp.float8_gather else 0.0


def describe(lp: LowPrecision, comm_saved: float, muon_bytes: float) -> list[str]:
    """The estimate's note lines for fp8 and Muon."""
    out = []
    if lp.fp8 is not None:
        out.append(f"model.fp8 {lp.fp8.recipe}: {lp.converted_local / 1e6:.2f} M weight elements per block in "
                   f"{'MXFP8' if lp.fp8.mx else 'float8'} (no autocast copies of them; their GEMMs at the float8 "
                   "rate)" + (f"; float8 all-gather saves {comm_saved / 2**30:.2f} GiB of all-gather per step"
                              if lp.float8_gather else ""))
    if lp.muon:
        out.append(f"optimizer muon: one fp32 momentum buffer per hidden matrix (AdamW's two moments for the rest); "
                   f"{muon_bytes / 2**30:.2f} GiB gathered per step (each cut matrix whole), "
                   f"{lp.ns_flops / 1e9:.1f} GFLOP of Newton-Schulz per block on every rank")
    return out


def apply_low_precision(e: Any, c: Any, acts: Any, shared: float, pipeline_rank: Optional[int]) -> None:
    """Redo `e`'s memory with the fp8 / Muon terms of its config and adjust its FSDP all-gather bytes, Muon's
    gathers and notes (in place; nothing when neither is on or under InternLM's accounting). `c`: the stage
    context the estimate used; `acts`, `shared`, `pipeline_rank`: what it picked its stage with."""
    from .memory import pick_stage

    lay, d = e.layout, e.cfg.data
    lp = low_precision(e.cfg, e.figures.block.linears, lay) if e.precision == "internlm_core" else LowPrecision()
    e.low_precision = lp
    if lp.fp8 is None and not lp.muon:
        return
    saving = gathered_saving(lp, c.gathered_itemsize) if lay.dp_shard > 1 else 0.0
    c2 = replace(c, figures=replace(c.figures, block_matrices_local=c.figures.block_matrices_local
                                    - lp.converted_local),
                 fp8_gathered=saving, fp8_casts=fp8_casts(lp, c.tokens, c.comp),
                 muon_matrices=fsdp_share(scaled(list(lp.hidden_terms), c.layers), lay))
    old, e.memory = e.memory, pick_stage(c2, acts, shared, pipeline_rank)
    for name in ("runtime", "host_offload"):  # set by the estimate after its pick
        if hasattr(old, name):
            setattr(e.memory, name, getattr(old, name))
    block_gathers = c.layers * (2 if lay.pp == 1 else 1) * d.micro_num if e.communication.gathers else 0
    before = f"{e.communication.gathered_bytes / 2**30:.2f} GiB gathered"
    e.communication.gathered_bytes -= block_gathers * saving
    after = f"{e.communication.gathered_bytes / 2**30:.2f} GiB gathered"
    e.notes = [n.replace(before, after) if n.startswith("FSDP per step:") else n for n in e.notes]
    e.muon_gather_bytes = 4 * lp.gathered_global * c.layers
    e.notes += describe(lp, block_gathers * saving, e.muon_gather_bytes)


def fp8_flops_per_token(e: Any, gpu: Any) -> float:
    """Forward FLOPs per token of a block's converted dense GEMMs on one device (speed.py prices them at the GPU's
    float8 rate); ConfigError where the GPU has no such GEMMs."""
    lp = e.low_precision
    if lp is None or lp.fp8 is None:
        return 0.0
    if lp.fp8.mx and not gpu.mxfp8:
        raise ConfigError(f"model.fp8 {lp.fp8.recipe}: {gpu.name} has no MXFP8 GEMMs (CUDA SM >= 10.0)")
    if not gpu.fp8_tflops:
        raise ConfigError(f"model.fp8 {lp.fp8.recipe}: {gpu.name} has no float8 GEMMs (torch._scaled_mm: SM >= 8.9)")
    return lp.converted_flops


def low_precision_terms(e: Any, gpu: Any) -> dict[str, float]:
    """Seconds per step (speed.py's terms): the float8 casts (memory-bound), Muon's all-gather of the cut matrices
    (exposed: the optimizer step follows the backward) and its Newton-Schulz iterations (every rank, whole)."""
    from .gpus import EFFICIENCY

    lp, d, lay = e.low_precision, e.cfg.data, e.layout
    if lp is None or (lp.fp8 is None and not lp.muon):
        return {}
    eff = EFFICIENCY[gpu.arch]
    tokens = d.micro_bsz * d.seq_len // lay.cp * d.micro_num
    comp = resolve_precision(e.cfg.model.dtype, "cuda").compute_dtype.itemsize
    out = {}
    if lp.fp8 is not None:
        cast_bytes = 2 * lp.cast_elements * (2 * comp + 1) * tokens * e.stage_layers
        out["float8 casts"] = cast_bytes / (gpu.hbm_gbs * 1e9 * eff["hbm"])
    if lp.muon:
        n = lay.dp_shard * lay.tp  # the matrix's mesh
        link = 1e9 * eff["link"] * (gpu.nvlink_gbs if n <= gpu.node_gpus else gpu.network_gbs)
        out["Muon all-gather"] = e.muon_gather_bytes * (n - 1) / max(n, 1) / link
        out["Muon Newton-Schulz"] = lp.ns_flops * e.stage_layers / (gpu.peak_tflops * 1e12 * eff["gemm"])
    return out
