"""Muon against AdamW on the demo corpus: 200 steps of configs/tiny.py (make demo's data and settings: byte
tokenizer, vocab 512, adam.lr 1e-3, warm-up cosine, fp32, one process), the same seed, optimizer.name adamw and
muon (Muon's lr and weight decay are AdamW's, its update RMS-matched: optim/muon.py). Prints the mean training
loss of the last 20 steps, the final validation loss (mean of the code and docs sets) and Muon's ratios to AdamW's.
The README's measurement (issue 37: Muon ties AdamW at step 200, 2.7154 against 2.7165) is what this reruns.

    python bench/muon_vs_adamw.py [--steps 200] [--reuse]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fp8_loss import LAST, demo_data, run  # noqa: E402
from bench.train_runs import write_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "build/bench_muon")
    ap.add_argument("--reuse", action="store_true", help="reuse the finished runs of an earlier invocation")
    a = ap.parse_args()
    train, valid = demo_data(ROOT / "build/bench_fp8_loss")  # the demo corpus, built once for both benchmarks
    results = [run(a.out, name, "off", a.steps, train, valid, a.reuse, (f"optimizer.name={name}",))
               for name in ("adamw", "muon")]
    base = results[0]
    rows = [f"| optimizer ({a.steps} steps, demo corpus, fp32) | train loss, last {LAST} | ratio to AdamW | "
            "validation loss | ratio |", "|---|---|---|---|---|"]
    rows += [f"| {r['name']} | {r['train']:.4f} | {r['train'] / base['train']:.4f} | {r['valid']:.4f} | "
             f"{r['valid'] / base['valid']:.4f} |" for r in results]
    write_table(a.out, rows)


if __name__ == "__main__":
    main()
