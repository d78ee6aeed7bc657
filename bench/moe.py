#!/usr/bin/env python
"""Mixture of experts on this CPU: tokens/s of a MoE model against a dense model of the same active parameters, the
expert GEMM kernels (per-expert loop, torch's grouped GEMM), and the all-to-all bytes of expert parallel against
the theoretical volume.

    python bench/moe.py [--steps 12] [--out build/bench_moe]

Models (configs/tiny.py by overrides, fp32, 4 layers, hidden 256, seq 256, micro_bsz 2, micro_num 2):
  dense      SwiGLU of width 1024
  moe        8 experts of width 512, top-2, dropless: each token multiplies 2 x 512 = 1024 columns, the dense
             model's active parameters (the router adds 8 x 256 per layer); 4x the dense FFN's parameters
  moe-grouped the same with moe.expert_gemm=grouped (torch._grouped_mm on the CPU)
  moe-ep2    expert parallel 2 on two processes (gloo): comm/all_to_all_bytes per step against
             4 * top_k * tokens * hidden * 4 bytes * layers * (1 - 1/ep) (dispatch and combine, forward and backward)
Throughput is the median `tgs` (tokens per second per rank) of the steps after the first 3.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from train_runs import train_records, write_table  # noqa: E402
SHAPE = ["model.dtype=torch.float32", "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4",
         "model.vocab_size=512", "data.seq_len=256", "data.micro_bsz=2", "data.micro_num=2", "data.valid_every=0",
         "data.fixed_random_dataset_seqlen=False", "monitor.tensorboard=False", "adam.lr=1e-3"]
MOE = ["model_type=INTERNLM_MoE", "model.num_experts=8", "moe.top_k=2", "model.moe_type=Dropless",
       "model.moe_intermediate_size=512"]
CASES = {
    "dense": (1, ["model.intermediate_size=1024"]),
    "moe": (1, MOE + ["moe.expert_gemm=loop"]),
    "moe-grouped": (1, MOE + ["moe.expert_gemm=grouped"]),
    "moe-ep2": (2, MOE + ["parallel.expert=2"]),
}


def run(name: str, nproc: int, sets: list[str], steps: int, out: Path) -> list[dict]:
    return train_records(out / name, nproc, "configs/tiny.py", [*SHAPE, *sets], steps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "build" / "bench_moe"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows = ["| case | ranks | tokens/s per rank | vs dense |", "|---|---:|---:|---:|"]
    tgs = {}
    for name, (nproc, sets) in CASES.items():
        records = run(name, nproc, sets, args.steps, out)
        tgs[name] = statistics.median(r["tgs"] for r in records[3:])
        rows.append(f"| {name} | {nproc} | {tgs[name]:,.0f} | {tgs[name] / tgs['dense']:.2f} |")
        print(rows[-1], flush=True)
        if name == "moe-ep2":
            tokens, hidden, layers, top_k, ep = 2 * 256 * 2, 256, 4, 2, 2
            theory = 4 * top_k * tokens * hidden * 4 * layers * (1 - 1 / ep)
            sent = [r["comm/all_to_all_bytes"] for r in records]
            rows.append(f"\nall-to-all bytes per step (rank 0, expert parallel 2): median {statistics.median(sent):,.0f}"
                        f", min {min(sent):,} max {max(sent):,}; balanced-routing theory {theory:,.0f} "
                        f"(median / theory {statistics.median(sent) / theory:.3f})")
            print(rows[-1], flush=True)
    write_table(out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
