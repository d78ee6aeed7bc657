#!/usr/bin/env python
"""Context-parallel attention on this CPU: peak memory and time of one attention forward + backward per rank, and
the bytes each rank sends, for one 8K-token row (bf16 by default) at C = 1, 2, 4.

    python bench/context_attention.py [--seq 8192] [--heads 8] [--kv-heads 2] [--head-dim 64] [--dtype bf16]

Rows (each in a fresh process: its peak RSS above the inputs is the row's memory):
  blocked     the CPU kernel of whole rows (model/attention.py blocked_causal_attention; autograd keeps every
              block's probabilities for backward, about T^2 / 2 of them)
  core        the context kernels' blockwise core on the whole row (C = 1: nothing of size T^2 kept)
  ring/all_to_all/2d C  rank 0 of C under a fake process group (PyTorch's: collectives move nothing and take no
              time, so the time is the compute of one rank; the bytes are counted where they would be sent)
Ratios are to `blocked`. The row is one document (the most attention work; documents only skip blocks).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = [("blocked", 1, 1), ("core", 1, 1), ("ring", 2, 1), ("all_to_all", 2, 1), ("ring", 4, 1),
         ("all_to_all", 4, 1), ("2d", 4, 2)]


def measure(mode: str, size: int, inner: int, a: argparse.Namespace) -> dict:
    """One case in this process (run by a fresh child): peak RSS above the inputs, seconds, bytes sent."""
    import time

    import torch
    import torch.distributed as dist

    from internlm_core.model.attention import blocked_causal_attention
    from internlm_core.model.context import (ContextGroup, build_context_meta, context_attention, make_inner_group,
                                             pop_context_bytes)
    from internlm_core.utils.memory import process_peak_rss, reset_peak_rss
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    T = a.seq // size
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, T, a.heads, a.head_dim, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(1, T, a.kv_heads, a.head_dim, generator=g).to(dtype).requires_grad_() for _ in range(2))
    meta = None
    if mode != "blocked":
        from torch.testing._internal.distributed.fake_pg import FakeStore
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
        ctx = ContextGroup(None, size, 0, "ring" if mode == "core" else mode, inner)
        make_inner_group(ctx)
        meta = build_context_meta(ctx, None, 1, T, torch.device("cpu"))
    pop_context_bytes()
    reset_peak_rss()
    base = process_peak_rss()
    start = time.perf_counter()
    if meta is None:
        out = blocked_causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    else:
        out = context_attention(q, k, v, meta)
    out.float().square().sum().backward()
    seconds = time.perf_counter() - start
    sent = pop_context_bytes()
    return {"peak_mib": (process_peak_rss() - base) / 2**20, "seconds": seconds,
            "sent_mib": sum(v for key, v in sent.items() if key != "layout") / 2**20}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--case", help=argparse.SUPPRESS)  # mode,size,inner: run one case here and print its json
    a = p.parse_args()
    if a.case:
        mode, size, inner = a.case.split(",")
        print(json.dumps(measure(mode, int(size), int(inner), a)))
        return
    rows = []
    for mode, size, inner in CASES:
        args = [sys.executable, __file__, "--case", f"{mode},{size},{inner}", "--seq", str(a.seq), "--heads",
                str(a.heads), "--kv-heads", str(a.kv_heads), "--head-dim", str(a.head_dim), "--dtype", a.dtype]
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append((f"{mode} C={size}" + (f" inner={inner}" if mode == "2d" else ""),
                     json.loads(done.stdout.splitlines()[-1])))
    ref = rows[0][1]
    print(f"one row of {a.seq} tokens, {a.heads} heads / {a.kv_heads} kv heads x {a.head_dim}, {a.dtype}: "
          f"attention forward + backward, per rank")
    print(f"{'case':<22}{'peak MiB':>10}{'x blocked':>11}{'seconds':>10}{'x blocked':>11}{'sent MiB':>10}")
    for name, r in rows:
        print(f"{name:<22}{r['peak_mib']:>10.1f}{r['peak_mib'] / ref['peak_mib']:>11.3f}{r['seconds']:>10.2f}"
              f"{r['seconds'] / ref['seconds']:>11.2f}{r['sent_mib']:>10.1f}")


if __name__ == "__main__":
    main()
