#!/usr/bin/env python
"""A second matmul peak, next to the peers' peak_flops.py: the same square products (2*n^3 FLOPs, n = 2048
and 4096, median time) on oneDNN's GEMM, which torch ships and uses for bf16 but not for fp32 (torch's fp32
matmul is MKL's sgemm, an AVX2 code path on AMD CPUs). The higher of the two is the better estimate of what
this CPU can do; bench/run.py reports MFU against both.

    python bench/hw_peak.py OUT_DIR        # writes OUT_DIR/hw_peak.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from internlm_core.utils import cpu_features


def gflops(n: int, dtype: torch.dtype, reps: int) -> float:
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    mm = torch.ops.mkldnn._linear_pointwise
    for _ in range(3):
        mm(a, b, None, "none", [], "")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mm(a, b, None, "none", [], "")
        times.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(times) / 1e9


def main(argv: list[str]) -> int:
    out = argv[0] if argv else "."
    res = {"threads": torch.get_num_threads(), "backend": "oneDNN (torch.ops.mkldnn._linear_pointwise)"}
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        res["error"] = "oneDNN not available in this torch"
    else:
        for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            if dt == torch.bfloat16 and dt not in cpu_features.detect().native_half_gemm:
                # oneDNN refuses a bf16 inner product on a CPU without native bf16 ("could not create a
                # primitive descriptor"); the bf16 peak is then the peers' emulated one, not measured here
                res["bf16"] = "no native bf16 GEMM on this CPU: not measured"
                continue
            for n, reps in ((2048, 20), (4096, 7)):
                res[f"{name}_{n}"] = gflops(n, dt, reps)
            res[f"peak_{name}_gflops"] = max(res[f"{name}_2048"], res[f"{name}_4096"])
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "hw_peak.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
