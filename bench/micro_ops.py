#!/usr/bin/env python
"""Micro-benchmarks behind the hot-path choices (forward + backward, median ms, this process's threads):
attention kernels, cross entropy, fused projections. Shapes are configs/bench_cpu.py's.

    python bench/micro_ops.py [attention|ce|proj|all] [--dtype fp32|bf16|both]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F


B, T, H, D, HID, FFN, V = 4, 512, 4, 64, 256, 688, 8192


def timeit(fn, reps=15, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def bench_attention(dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, T, D, dtype=dtype)

    def run(f):
        def step():
            o = f(q, k, v)
            torch.autograd.backward(o, g)
            q.grad = k.grad = v.grad = None
        return step

    def flash(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def math(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    out = {"sdpa flash (causal)": timeit(run(flash)), "sdpa math (causal)": timeit(run(math))}
    from internlm_core.model.attention import blocked_causal_attention
    out["blocked matmuls (ours)"] = timeit(run(blocked_causal_attention))
    return out


def bench_ce(dtype):
    from internlm_core.loss import FlashGPTLMLoss
    x = (3 * torch.randn(B * T, V)).to(dtype).requires_grad_()
    y = torch.randint(0, V, (B * T,))

    def run(kernel):
        f = FlashGPTLMLoss(kernel)

        def step():
            loss, side = f(x, y)
            loss.backward()
            if side.predictions is None:
                x.detach().argmax(-1)
            x.grad = None
        return step
    return {"torch CE + argmax": timeit(run("torch")), "fused chunked CE": timeit(run("fused_chunked"))}


def bench_proj(dtype):
    x = torch.randn(B * T, HID, requires_grad=True)
    ws = [torch.randn(n, HID, requires_grad=True) for n in (HID, HID, HID)]
    wf = [torch.randn(n, HID, requires_grad=True) for n in (FFN, FFN)]
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if dtype == torch.bfloat16 else None

    def run(f):
        def step():
            if ctx:
                with ctx():
                    o = f()
            else:
                o = f()
            sum(t.float().sum() for t in o).backward()
        return step
    return {"q,k,v separate": timeit(run(lambda: [F.linear(x, w) for w in ws])),
            "q,k,v one matmul": timeit(run(lambda: F.linear(x, torch.cat(ws)).split(HID, -1))),
            "gate,up separate": timeit(run(lambda: [F.linear(x, w) for w in wf])),
            "gate,up one matmul": timeit(run(lambda: F.linear(x, torch.cat(wf)).split(FFN, -1)))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", nargs="?", default="all", choices=("attention", "ce", "proj", "all"))
    p.add_argument("--dtype", default="both", choices=("fp32", "bf16", "both"))
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--default-malloc", action="store_true",
                   help="leave glibc's allocator as it is (the trainer keeps freed memory, see utils/memory.py)")
    a = p.parse_args(argv)
    if not a.default_malloc:
        from internlm_core.utils.memory import keep_freed_cpu_memory
        keep_freed_cpu_memory()
    if a.threads:
        torch.set_num_threads(a.threads)
    dtypes = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "both": [torch.float32, torch.bfloat16]}[a.dtype]
    for dt in dtypes:
        for name, fn in (("attention", bench_attention), ("ce", bench_ce), ("proj", bench_proj)):
            if a.what in (name, "all"):
                for k, v in fn(dt).items():
                    print(f"{str(dt)[6:]:9} {name:9} {k:24} {v:8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
