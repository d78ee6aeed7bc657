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

# Dense peak TFLOP/s (no sparsity) per GPU for bf16/fp16 tensor cores, and for tf32/fp32.
_GPU_PEAK_TFLOPS = {
    "H200": (989.0, 494.0), "H100": (989.0, 494.0), "H800": (989.0, 494.0), "H20": (148.0, 74.0),
    "A100": (312.0, 156.0), "A800": (312.0, 156.0), "A10": (125.0, 62.5), "L40S": (362.0, 183.0),
    "L40": (181.0, 90.5), "V100": (125.0, 15.7), "B200": (2250.0, 1100.0), "4090": (165.0, 82.6),
}


def gpu_peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Table peak for a GPU name (None for a GPU we do not know: MFU is then not reported)."""
    low_precision = dtype in (torch.bfloat16, torch.float16)
    for key, (lp, tf32) in _GPU_PEAK_TFLOPS.items():
        if key in device_name.upper().replace("NVIDIA ", ""):
            return 1e12 * (lp if low_precision else tf32)
    return None


@functools.lru_cache(maxsize=None)
def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, max_n: int = 2048, seconds: float = 1.0) -> float:
    """Median FLOP/s of square `torch.matmul`s (2*n^3 FLOPs each) with this process's threads.

    This is the practical peak that the peer benchmark uses as MFU denominator (n=2048 and 4096
    there). n grows from 256 while one product takes under 20 ms, up to `max_n`, so that a dtype
    with a slow CPU kernel (fp16 here) costs a second at start-up, not minutes.
    """
    n = 256
    while True:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        t0 = time.perf_counter()
        a @ b
        if n >= max_n or time.perf_counter() - t0 > 0.02:
            break
        n *= 2
    a @ b
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        a @ b
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
    return f"{model}|{torch.get_num_threads()} threads|{dtype}|torch {torch.__version__}"


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


def device_peak_flops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """Peak FLOP/s of `device` for `dtype` compute; logs where the number comes from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name, dtype)
        if peak is None:
            logger.warning(f"no peak FLOP/s known for GPU {name!r}: MFU will not be reported")
        return peak
    if device.type == "cpu":
        peak = cpu_peak_flops(dtype)
        logger.info(f"CPU matmul peak ({dtype}, {torch.get_num_threads()} threads): {peak / 1e9:.1f} GFLOP/s "
                    f"(best measured on this CPU)")
        return peak
    logger.warning(f"no peak FLOP/s for device type {device.type}: MFU will not be reported")
    return None
