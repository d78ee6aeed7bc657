#!/usr/bin/env python
"""Context parallel on this CPU: training tokens/s at 8K tokens per sequence, CP 2 against CP 1, and the bytes each
rank sends for attention against the theoretical ring / all-to-all volume.

    python bench/context.py [--steps 8] [--seq 8192] [--out build/bench_context]

Model: configs/tiny.py by overrides, fp32, 4 layers, hidden 256, 4 query heads and 2 k/v heads of 64 channels,
one row of `--seq` tokens per step (micro_bsz 1, micro_num 1), the dummy dataset's packed documents.
Cases: cp1 (one process), cp2-ring and cp2-all_to_all (two processes over gloo, the same rows). Throughput is the
median over the steps after the first 2 of the job's tokens per second (tgs x ranks: tgs is per rank). The
theoretical bytes are model/context's `predicted_context_bytes` (what one rank must send for one forward and
backward of every layer, written from the shapes); the measured are the step's comm/context_<mode>_bytes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from train_runs import train_records, write_table  # noqa: E402

LAYERS, HIDDEN, HEADS, KV_HEADS = 4, 256, 4, 2
CASES = {"cp1": (1, []), "cp2-ring": (2, ["parallel.context={'size': 2, 'mode': 'ring'}"]),
         "cp2-all_to_all": (2, ["parallel.context={'size': 2, 'mode': 'all_to_all'}"])}


def run(name: str, nproc: int, sets: list[str], seq: int, steps: int, out: Path) -> list[dict]:
    shape = ["model.dtype=torch.float32", f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}",
             f"model.num_attention_heads={HEADS}", f"model.num_kv_attention_heads={KV_HEADS}",
             "model_type=INTERNLM2", "model.vocab_size=512", f"data.seq_len={seq}", "data.micro_bsz=1",
             "data.micro_num=1", "data.valid_every=0", "monitor.tensorboard=False", "adam.lr=1e-3"]
    return train_records(out / name, nproc, "configs/tiny.py", [*shape, *sets], steps)


def main(argv: list[str] | None = None) -> int:
    from internlm_core.model.context import predicted_context_bytes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--out", default=str(ROOT / "build" / "bench_context"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows = ["| case | ranks | job tokens/s | vs cp1 | attention bytes sent per step and rank | theory | ratio |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    job = {}
    for name, (nproc, sets) in CASES.items():
        records = run(name, nproc, sets, args.seq, args.steps, out)
        job[name] = statistics.median(r["tgs"] for r in records[2:]) * nproc
        sent = theory = None
        if nproc > 1:
            mode = name.split("-", 1)[1]
            sent = statistics.median(r.get(f"comm/context_{mode}_bytes", 0) for r in records)
            theory = predicted_context_bytes(mode, nproc, 1, 1, args.seq, HEADS, KV_HEADS, HIDDEN // HEADS, 4, LAYERS)
        cells = [f"{sent:,.0f}", f"{theory:,}", f"{sent / theory:.3f}"] if sent is not None else ["-", "-", "-"]
        rows.append(f"| {name} | {nproc} | {job[name]:,.0f} | {job[name] / job['cp1']:.2f} | " + " | ".join(cells)
                    + " |")
        print(rows[-1], flush=True)
    write_table(out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
