#!/usr/bin/env python
"""Packed-loader throughput (tokens/s) from our format, InternLM's format and the dummy dataset.

The same random corpus (log-normal document lengths, mean about 400 tokens) is written in both formats; the
training loader (`build_train_loader`, shuffling, packing with cu_seqlens, labels, positions, type ids, collation
to tensors, the vocabulary check) is iterated in the calling thread, for the batch shapes of configs/tiny.py and
of a 7B-style run (seq_len 2048, micro_bsz 1, micro_num 4). Tokens/s counts the packed input tokens delivered.

The reference is what configs/tiny.py trains per second on this machine: `--train-tgs`, or measured by running
`train.py --config configs/tiny.py` for a few steps (its `tgs`, median of the steps after warm-up); the table
shows how many times faster the loader is (target: at least 50x).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402

from internlm_core.config.schema import DataConfig  # noqa: E402
from internlm_core.data import build_train_loader  # noqa: E402
from internlm_core.data.formats import InternLMWriter, OursWriter  # noqa: E402


def write_corpus(folder: Path, tokens: int, vocab: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.extend(np.clip(rng.lognormal(5.5, 1.0, size=1000), 1, 16384).astype(int).tolist())
    ids = rng.integers(0, vocab, size=sum(lengths))
    for fmt, cls in (("ours", OursWriter), ("internlm", InternLMWriter)):
        d = folder / fmt / "web"
        d.mkdir(parents=True)
        w = cls(str(d / "part0.bin"), str(d / "part0.bin.meta"), vocab)
        w.write_many(ids, lengths)
        w.close()


def loader_speed(cfg: DataConfig, vocab: int, seconds: float) -> tuple[float, float]:
    t0 = time.perf_counter()
    ld = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=vocab)
    it = iter(ld)
    next(it)
    first = time.perf_counter() - t0
    n, t0 = 0, time.perf_counter()
    while True:
        for _ in range(10):
            n += next(it)["input_ids"].numel()
        dt = time.perf_counter() - t0
        if dt >= seconds:
            return n / dt, first


def tiny_train_tgs(steps: int = 14) -> float | None:
    run = Path(tempfile.mkdtemp(prefix="bench_tiny_"))
    try:
        p = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "tiny.py"),
                            "--set", f"data.total_steps={steps}", "data.valid_every=0", "--run-dir", str(run)],
                           capture_output=True, text=True, timeout=600, cwd=ROOT)
        if p.returncode != 0:
            tail = [line for line in (p.stderr + p.stdout).splitlines() if line.strip()][-1:]
            print(f"(train.py failed with status {p.returncode}: {tail[0] if tail else 'no output'}; "
                  "pass --train-tgs to compare)")
            return None
        tgs = [r["tgs"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
               if r.get("kind") == "train" and r.get("step", 0) > 4 and "tgs" in r]
        return statistics.median(tgs) if tgs else None
    finally:
        shutil.rmtree(run, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4_000_000, help="corpus size in tokens")
    p.add_argument("--vocab", type=int, default=103168)
    p.add_argument("--seconds", type=float, default=1.5, help="measuring time per row")
    p.add_argument("--train-tgs", type=float, default=None,
                   help="tokens/s configs/tiny.py trains at (default: measure with train.py)")
    args = p.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="bench_loader_"))
    try:
        t0 = time.perf_counter()
        write_corpus(tmp, args.tokens, args.vocab)
        print(f"corpus: {args.tokens / 1e6:.1f}M tokens, vocab {args.vocab}, written in {time.perf_counter() - t0:.1f} s "
              f"(ours {(tmp / 'ours' / 'web' / 'part0.bin').stat().st_size / 1e6:.0f} MB, "
              f"InternLM {(tmp / 'internlm' / 'web' / 'part0.bin').stat().st_size / 1e6:.0f} MB)")
        shapes = {"tiny (256 x 2, micro_num 2)": dict(seq_len=256, micro_bsz=2, micro_num=2),
                  "7B-style (2048 x 1, micro_num 4)": dict(seq_len=2048, micro_bsz=1, micro_num=4)}
        rows = []
        for shape, kw in shapes.items():
            kw = dict(kw, packed_length=kw["seq_len"] * kw["micro_bsz"], seed=1)
            for name, extra in (("ours", dict(train_folder=str(tmp / "ours"))),
                                ("InternLM", dict(train_folder=str(tmp / "internlm"))),
                                ("dummy uniform", dict(dummy_num_samples=20000)),
                                ("dummy zipf, random lengths", dict(dummy_num_samples=20000, dummy_distribution="zipf",
                                                                   fixed_random_dataset_seqlen=False))):
                tps, first = loader_speed(DataConfig(**kw, **extra), args.vocab, args.seconds)
                rows.append((shape, name, tps, first))
        tgs = args.train_tgs
        source = "given"
        if tgs is None:
            tgs, source = tiny_train_tgs(), "measured: train.py --config configs/tiny.py, median tgs"
        print(f"{'batch shape':34s} {'data':28s} {'tokens/s':>12s} {'first batch s':>14s} {'x tiny training':>16s}")
        for shape, name, tps, first in rows:
            ratio = f"{tps / tgs:15.0f}x" if tgs else "             n/a"
            print(f"{shape:34s} {name:28s} {tps:12,.0f} {first:14.3f} {ratio}")
        print(f"tiny training consumes {tgs:,.0f} tokens/s ({source})" if tgs else "tiny training speed: n/a")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
