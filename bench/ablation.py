#!/usr/bin/env python
"""What each CPU fast path is worth: configs/bench_cpu.py trained with one of them switched back to the plain
PyTorch path at a time (a monkeypatch in a fresh process), runs interleaved round robin, median step time.

    python bench/ablation.py [--dtypes fp32,bf16] [--repeat 3] [--steps 25] [--variants all,-onednn,...] [--compile]

Variants (each removes one fast path from `all`):
  all          everything on (what train.py runs)
  -onednn      fp32 linears on torch's F.linear (MKL sgemm) instead of oneDNN's GEMM
  -blocked     attention on SDPA (model.attn_backend=sdpa) instead of blocked matmul attention (cpu_blocked)
  -fused_ce    torch's cross entropy (fp32 log-softmax, separate argmax for the metric) instead of the fused one
  -malloc      glibc's default allocator behaviour (mmap + trim of large blocks) instead of keeping freed memory
  -all         all four removed
  -compiled_ce (with --compile, model.compile=True) the fused cross entropy eager instead of compiled
  -blocked_doc packed documents through SDPA with a dense [B, 1, T, T] document mask instead of blocked
               matmul attention with per-block document masks (only differs on data with several documents
               per row: pass --set data.train_folder=..., e.g. the short-document corpus of bench/real_data.py)
Step times are the trainer's `step_time` (whole step), median of the steps after the first 5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("all", "-onednn", "-blocked", "-fused_ce", "-malloc", "-all")  # and "-compiled_ce"


def patch(variant: str) -> list[str]:
    """Switch fast paths off in this process (before the trainer is built); returns config overrides."""
    off = {"-onednn", "-blocked", "-fused_ce", "-malloc"} if variant == "-all" else {variant}
    if "-onednn" in off:
        import dataclasses

        from internlm_core.utils import cpu_features
        cpu_features.pin(dataclasses.replace(cpu_features.detect(), onednn_linear=False))
    sets = ["model.attn_backend=sdpa"] if "-blocked" in off else []
    if "-fused_ce" in off:
        import internlm_core.numerics.kernels as K
        K.select_cross_entropy = lambda *args, **kwargs: "torch"
    if "-blocked_doc" in off:
        import internlm_core.model.attention as A
        A._layout_for_documents = lambda seg, backend, device: (A._causal_document_mask(seg.to(device)), None)
    if "-compiled_ce" in off:
        import internlm_core.loss as L
        L._compiled_chunk = lambda: None
    if "-malloc" in off:
        import internlm_core.trainer.build as TR
        TR.keep_freed_cpu_memory = lambda: False
    return sets


def child(variant: str, steps: int, sets: list[str]) -> None:
    sets = sets + patch(variant)
    import logging

    from internlm_core.config import load_config
    from internlm_core.distributed import init_distributed
    from internlm_core.trainer.build import build_trainer
    launch = init_distributed(None)
    cfg = load_config(str(ROOT / "configs" / "bench_cpu.py"),
                      sets + [f"data.total_steps={steps}", "monitor.log_every=1000"], world_size=1)
    with tempfile.TemporaryDirectory() as d:
        trainer = build_trainer(cfg, launch, Path(d))
        logging.disable(logging.INFO)
        trainer.train()
        rows = [json.loads(line) for line in open(Path(d) / "metrics.jsonl")]
    t = [r["step_time"] for r in rows if r["kind"] == "train"][5:]
    print(json.dumps({"median_ms": 1e3 * statistics.median(t), "loss": rows[-1]["loss"]}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--compile", action="store_true", help="model.compile=True for every variant")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every run")
    a = p.parse_args(argv)
    if a.child:
        child(a.child, a.steps, a.set)
        return 0
    dtypes = {"fp32": "torch.float32", "bf16": "torch.bfloat16"}
    res: dict = {}
    for _ in range(a.repeat):
        for dt in a.dtypes.split(","):
            for v in a.variants.split(","):
                out = subprocess.run([sys.executable, __file__, f"--child={v}", "--steps", str(a.steps), "--set",
                                      f"model.dtype={dtypes[dt]}", f"model.compile={a.compile}", *a.set],
                                     capture_output=True, text=True, cwd=ROOT)
                if out.returncode != 0:
                    print(out.stderr[-2000:])
                    return 1
                r = json.loads(out.stdout.strip().splitlines()[-1])
                res.setdefault((dt, v), []).append(r["median_ms"])
                print(f"{dt} {v:10} {r['median_ms']:7.1f} ms  loss {r['loss']:.4f}", flush=True)
    print(f"\n{'dtype':5} {'variant':10} {'step ms (median of runs)':>24} {'vs all':>7}  runs")
    for dt in a.dtypes.split(","):
        base = statistics.median(res[(dt, "all")]) if (dt, "all") in res else None
        for v in a.variants.split(","):
            m = statistics.median(res[(dt, v)])
            rel = f"{m / base:6.2f}x" if base else ""
            print(f"{dt:5} {v:10} {m:24.1f} {rel:>7}  {' '.join(f'{x:.0f}' for x in res[(dt, v)])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
