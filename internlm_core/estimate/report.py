"""The human-readable report of an estimate, and the short forms `train.py --dry-run` prints."""

from __future__ import annotations

from typing import Any, Optional

from ..config import Config
from .core import estimate
from .figures import GiB, Estimate, Memory


def _activated(e: Estimate) -> str:
    """"; N B activated per token" for a family whose counts say it (ModelCounts.active_parameters), else ""."""
    active = getattr(e.figures, "counts", None) and e.figures.counts.active_parameters
    return f"; {active(e.model_args) / 1e9:.3f} B activated per token" if active else ""


def format_estimate(e: Estimate, other: Optional[Estimate] = None) -> str:
    """The human-readable report; `other` (the other precision) adds a one-line comparison."""
    cfg, lay, mem = e.cfg, e.layout, e.memory
    d = cfg.data
    lines = [
        f"model {cfg.model_type}: {e.parameters:,} parameters ({e.parameters / 1e9:.3f} B; "
        f"{e.nonembedding_parameters / 1e9:.3f} B without the input embedding{_activated(e)})",
        f"FLOPs per token: {e.model_flops_per_token / 1e9:.2f} GFLOP model (6N + 12*L*h*s, s={d.seq_len})"
        + (f", {e.hardware_flops_per_token / 1e9:.2f} GFLOP with recomputation"
           if e.hardware_flops_per_token != e.model_flops_per_token else ""),
        f"layout: {lay.describe()}",
        f"batch: micro_bsz {d.micro_bsz} x seq_len {d.seq_len} x micro_num {d.micro_num} x dp {lay.data} = "
        f"{e.tokens_per_step:,} tokens per step",
        f"memory per device ({cfg.model.dtype.split('.')[-1]}, precision {e.precision}"
        + (f", stage {mem.stage}" if lay.pp > 1 else "") + "):",
    ]
    accumulating = e.precision == "internlm_core" and lay.dp_shard > 1 and d.micro_num > 1
    for k in Memory.ORDER:
        v = getattr(mem, k)
        if v or k in ("parameters", "gradients", "optimizer", "activations") or \
                (k == "accumulated_gradients" and accumulating):
            why = {"micro_batch": "  (0: reduce-scattered every micro-batch)",
                   "step": "  (unsharded fp32 until the last micro-batch)"}[e.grad_reduce] \
                if k == "accumulated_gradients" else ""
            lines.append(f"  {Memory.LABELS[k]:<22} {v / GiB:9.2f} GiB{why}")
    fits = ""
    if e.device_memory:  # the context and NCCL's buffers take their share of the device too
        fits = (f"  (fits in {e.device_memory / GiB:g} GiB)" if mem.total + e.device_runtime <= e.device_memory
                else f"  (does NOT fit in {e.device_memory / GiB:g} GiB)")
    lines.append(f"  {'total (peak)':<22} {mem.total / GiB:9.2f} GiB{fits}")
    if mem.host_offload:
        lines.append(f"  {'+ offloaded to host':<22} {mem.host_offload / GiB:9.2f} GiB  (model.offload_activations: "
                     "host memory, not the device's)")
    if e.device_runtime:
        lines.append(f"  {'+ CUDA context, NCCL':<22} {e.device_runtime / GiB:9.2f} GiB  (outside the allocator: "
                     "nvidia-smi shows it, torch.cuda.max_memory_reserved does not)")
    if other is not None:
        lines.append(f"  (precision {other.precision}: {other.memory.total / GiB:.2f} GiB; states "
                     f"{other.memory.states / GiB:.2f} GiB)")
    lines.append(f"time per step at MFU {e.mfu:.0%} of {e.peak_flops / 1e12:g} TFLOP/s: {e.step_time:.2f} s "
                 f"({e.tokens_per_device_per_second:,.0f} tokens per device per second)")
    lines += [f"note: {n}" for n in e.notes]
    return "\n".join(lines)


def memory_per_device(cfg: Config, args: Any, world_size: int = 1) -> dict[str, float]:
    """Bytes per device for parameters, gradients and optimizer state (this code base's precision)."""
    mem = estimate(cfg, world_size, args=args).memory
    return {"parameters": mem.parameters, "gradients": mem.gradients, "optimizer": mem.optimizer}


def describe(cfg: Config, args: Any, world_size: int = 1) -> str:
    """Human-readable summary for `train.py --dry-run`: size, FLOPs per token, memory per device, step time."""
    return format_estimate(estimate(cfg, world_size, args=args))
