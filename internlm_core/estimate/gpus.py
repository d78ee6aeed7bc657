"""The GPUs the speed prediction knows (peak, memory and link bandwidths) and the efficiency it assumes per kernel
class. Every efficiency below is an ASSUMPTION taken from published measurements of the same kernels on the same
GPUs, not a measurement of this code base (no GPU has run it yet): tools/gpu_check.sh prints the prediction beside
the measured tokens/s and MFU of configs/bench_gpu.py, which is where these numbers get corrected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..utils.peak import gpu_peak_flops


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: `peak_tflops` dense bf16 (utils/peak.py's table, the MFU denominator the trainer uses),
    `hbm_gbs` HBM bandwidth, `nvlink_gbs` NVLink bandwidth per GPU and direction, `network_gbs` the inter-node
    network per GPU and direction (one NIC per GPU), all in GB/s (1e9 bytes); `node_gpus` GPUs per NVLink domain."""

    name: str
    arch: str            # "hopper" or "ampere": which column of EFFICIENCY applies
    peak_tflops: float
    memory_gib: float
    hbm_gbs: float
    nvlink_gbs: float
    network_gbs: float
    node_gpus: int = 8
    fp8_tflops: float = 0.0  # dense float8 (e4m3) GEMMs, 2x bf16 on Hopper; 0: none (torch._scaled_mm needs SM 8.9)
    mxfp8: bool = False      # MXFP8 block-scaled GEMMs (SM >= 10.0)


def _gpu(name: str, device_name: str, arch: str, memory_gib: float, hbm: float, nvlink: float,
         network: float, fp8: float = 0.0) -> GpuSpec:
    peak = gpu_peak_flops(device_name, torch.bfloat16)
    assert peak is not None, device_name  # the table below only names GPUs utils/peak.py knows
    return GpuSpec(name, arch, peak / 1e12, memory_gib, hbm, nvlink, network, fp8_tflops=fp8 * peak / 1e12)


# Sources (NVIDIA datasheets; NVLink figures are the total of both directions there, halved here):
#   H100 SXM5 80 GB: 989 TFLOP/s dense bf16, HBM3 3.35 TB/s, NVLink 4 900 GB/s; DGX H100: one ConnectX-7
#     400 Gb/s NDR InfiniBand port per GPU (50 GB/s per direction).
#   H200 SXM 141 GB: 989 TFLOP/s dense bf16 (the H100's tensor cores), HBM3e 4.8 TB/s, NVLink 4 900 GB/s;
#     DGX H200: 400 Gb/s NDR per GPU.
#   H100 / H200 SXM: 1,979 TFLOP/s dense FP8 (e4m3 / e5m2), twice bf16; no MXFP8 (block-scaled) GEMMs, which
#     need Blackwell (SM 10.0).
#   A100 SXM4 80 GB: 312 TFLOP/s dense bf16, HBM2e 2,039 GB/s, NVLink 3 600 GB/s; DGX A100: one 200 Gb/s HDR
#     InfiniBand port per GPU (25 GB/s per direction).
GPUS = {
    "h100": _gpu("H100 SXM 80GB", "H100 SXM", "hopper", 80, 3350, 450, 50, fp8=2.0),
    "h200": _gpu("H200 SXM 141GB", "H200", "hopper", 141, 4800, 450, 50, fp8=2.0),
    "a100": _gpu("A100 SXM 80GB", "A100 SXM", "ampere", 80, 2039, 300, 25),
}

# Achievable fraction of peak per kernel class and GPU generation (assumptions; sources named):
#   gemm            cuBLAS bf16 GEMMs of a transformer's shapes in a training step: 60% of peak on Hopper, 65% on
#                   A100. Isolated large bf16 GEMMs reach ~70% (H100 SXM, 600-750 TFLOP/s) and ~80% (A100); those
#                   figures predicted two published end-to-end runs 20-30% too fast (InternLM's 7B on A100: 4,103
#                   tokens/s/GPU, 183 TFLOP/s, predicted 5,201 at 80%; torchtitan's Llama 3.1 8B on 8 H100 at
#                   500 W, seq 8192, eager: 5,762, predicted 9,920 at 700 W), so they are lowered here: with these,
#                   InternLM's 7B on A100 is predicted at ~4,350 (+6%).
#   expert_grouped  torch._grouped_mm over the local experts, balanced routing: smaller, ragged GEMMs: ~60%.
#   expert_loop     one GEMM per expert (a launch and a tail each): ~50%.
#   flash_fwd/_bwd  FlashAttention-2 (flash-attn, and torch's varlen_attn, which runs FA2's kernels): Dao 2023
#                   reports up to 73% of A100's peak forward, ~45-63% backward; on H100 FA2 reaches ~330-350
#                   TFLOP/s forward and ~250-300 backward (FlashAttention-3 paper's FA2 baselines).
#   sdpa_mask_fwd/_bwd  SDPA with a dense [B,1,T,T] document mask: torch's memory-efficient (cutlass) kernel with
#                   a bias, no causal or cross-document block skipping (counted as full rows, see speed.py): about
#                   60% of FA2's rate.
#   hbm             fraction of the HBM bandwidth elementwise / memory-bound kernels reach (~80-90% for large
#                   streaming kernels; 75% here: norms, rotary, SwiGLU, adds and the optimizer are many kernels).
#   link            NCCL bus bandwidth over the link's per-direction bandwidth (~80% for large messages).
EFFICIENCY = {
    "hopper": {"gemm": 0.60, "expert_grouped": 0.60, "expert_loop": 0.50, "flash_fwd": 0.34, "flash_bwd": 0.28,
               "sdpa_mask_fwd": 0.20, "sdpa_mask_bwd": 0.17, "hbm": 0.75, "link": 0.80},
    "ampere": {"gemm": 0.65, "expert_grouped": 0.60, "expert_loop": 0.55, "flash_fwd": 0.65, "flash_bwd": 0.50,
               "sdpa_mask_fwd": 0.40, "sdpa_mask_bwd": 0.30, "hbm": 0.75, "link": 0.80},
}


def gpu_spec(name: str) -> GpuSpec:
    """The table's GPU of that name (h100, h200, a100; case-insensitive); ConfigError naming the known ones."""
    key = name.lower().replace("-", "").replace(" ", "")
    if key not in GPUS:
        raise ConfigError(f"--gpu {name}: unknown GPU; expected one of {', '.join(GPUS)}")
    return GPUS[key]
