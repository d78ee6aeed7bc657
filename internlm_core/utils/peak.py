"""Peak FLOP/s of one device, the denominator of MFU: a table for GPUs, a measurement on CPU."""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from pathlib import Path
from typing import Optional

import torch

from .logging import get_logger

logger = get_logger(__name__)

# Dense peak TFLOP/s (no sparsity) per GPU: (bf16/fp16 tensor cores, tf32 tensor cores, fp32 without tensor
# cores), from NVIDIA's datasheets. Matched in this order against the upper-cased device name, so that the PCIe
# and NVL variants of a GPU (lower clocks and power) come before its SXM entry, and H200 before H20.
_GPU_PEAK_TFLOPS = (
    ("H100 PCIE", (756.0, 378.0, 51.0)), ("H100 NVL", (835.0, 418.0, 60.0)), ("H200 NVL", (835.0, 418.0, 60.0)),
    ("H800 PCIE", (756.0, 378.0, 51.0)), ("H200", (989.0, 494.0, 67.0)), ("H100", (989.0, 494.0, 67.0)),
    ("H800", (989.0, 494.0, 67.0)), ("H20", (148.0, 74.0, 44.0)), ("A100", (312.0, 156.0, 19.5)),
    ("A800", (312.0, 156.0, 19.5)), ("A10", (125.0, 62.5, 31.2)), ("L40S", (362.0, 183.0, 91.6)),
    ("L40", (181.0, 90.5, 90.5)), ("V100", (125.0, 15.7, 15.7)), ("B200", (2250.0, 1100.0, 80.0)),
    ("4090", (165.0, 82.6, 82.6)),
)


def gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> Optional[float]:
    """Table peak for a GPU name and the run's compute: 16-bit tensor cores, TF32 tensor cores (fp32 with TF32
    matmuls on), or plain fp32 (TF32 off, torch's default); None for a GPU we do not know (no MFU then)."""
    column = 0 if dtype in (torch.bfloat16, torch.float16) else 1 if tf32 else 2
    name = device_name.upper().replace("NVIDIA ", "")
    for key, peaks in _GPU_PEAK_TFLOPS:
        if key in name:
            return 1e12 * peaks[column]
    return None


def _cpu_linear(dtype: torch.dtype):
    """The matmul a CPU run's linear layers execute (x @ w^T): oneDNN's fp32 GEMM where torch has it (the model's
    fp32 linear), F.linear otherwise (16-bit: a different, much faster kernel than a square `a @ b`)."""
    if dtype == torch.float32 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                                   "_linear_pointwise"):
        return "onednn", lambda a, b: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    return "F.linear", torch.nn.functional.linear


@functools.lru_cache(maxsize=None)
def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, max_n: int = 2048, seconds: float = 1.0) -> float:
    """Median FLOP/s of square products x @ w^T (2*n^3 FLOPs each) on the kernel the model's linear layers use
    (see _cpu_linear), with this process's threads.

    This is the practical peak that the peer benchmark uses as MFU denominator (n=2048 and 4096
    there). n grows from 256 while one product takes under 20 ms, up to `max_n`, so that a dtype
    with a slow CPU kernel costs a second at start-up, not minutes.
    """
    _, mm = _cpu_linear(dtype)
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t0 = time.perf_counter()
        mm(a, b)
        if n >= max_n or time.perf_counter() - t0 > 0.02:
            break
        n *= 2
    mm(a, b)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        mm(a, b)
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def _cpu_key(dtype: torch.dtype) -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}|{torch.get_num_threads()} threads|{dtype}|{_cpu_linear(dtype)[0]}|torch {torch.__version__}"


def cpu_peak_flops(dtype: torch.dtype, cache_file: Optional[Path] = None) -> float:
    """The best of this measurement and earlier ones on the same CPU model and thread count.

    A start-up measurement is lowered by anything else running at that moment; the peak is a
    property of the machine, so the highest figure seen is the better estimate. The cache lives in
    ~/.cache/internlm_core/peak_flops.json (INTERNLM_CORE_CACHE overrides the folder).
    """
    cache_file = cache_file or Path(os.environ.get("INTERNLM_CORE_CACHE", Path.home() / ".cache" / "internlm_core")) \
        / "peak_flops.json"
    key = _cpu_key(dtype)
    measured = measure_cpu_peak_flops(dtype)
    try:
        seen = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        seen = {}
    best = max(measured, float(seen.get(key, 0.0)))
    if best > float(seen.get(key, 0.0)):
        seen[key] = best
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(seen, indent=1))
            tmp.replace(cache_file)
        except OSError:  # a read-only home only costs us the cache
            pass
    return best


def device_peak_flops(device: torch.device, dtype: torch.dtype, tf32: bool = False) -> Optional[float]:
    """Peak FLOP/s of `device` for `dtype` compute (`tf32`: fp32 matmuls on TF32 tensor cores; numerics'
    Precision says which); logs where the number comes from. INTERNLM_CORE_PEAK_TFLOPS (TFLOP/s of one
    device) overrides the table and the CPU measurement: a GPU the table lacks, a fixed CPU denominator for
    comparing runs, or no start-up measurement (~1 s of CPU per process)."""
    override = os.environ.get("INTERNLM_CORE_PEAK_TFLOPS")
    if override:
        try:
            peak = float(override) * 1e12
        except ValueError:
            peak = 0.0
        if peak > 0:
            logger.info(f"peak for MFU: {peak / 1e12:g} TFLOP/s per device (INTERNLM_CORE_PEAK_TFLOPS)")
            return peak
        logger.warning(f"INTERNLM_CORE_PEAK_TFLOPS={override!r} is not a positive number: ignored")
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype, tf32)
        if peak is None:
            logger.warning(f"no peak FLOP/s known for GPU {name!r}: MFU will not be reported")
        else:
            kind = "16-bit" if dtype in (torch.bfloat16, torch.float16) else "tf32" if tf32 else "fp32 (TF32 off)"
            logger.info(f"GPU peak for MFU: {name}, {kind} dense {peak / 1e12:g} TFLOP/s")
        return peak
    if device.type == "cpu":
        peak = cpu_peak_flops(dtype)
        logger.info(f"CPU peak for MFU ({dtype} x @ w^T on {_cpu_linear(dtype)[0]}, {torch.get_num_threads()} threads): "
                    f"{peak / 1e9:.1f} GFLOP/s "
                    f"(best measured on this CPU)")
        return peak
    logger.warning(f"no peak FLOP/s for device type {device.type}: MFU will not be reported")
    return None
