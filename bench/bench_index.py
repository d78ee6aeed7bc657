#!/usr/bin/env python
"""Index memory per rank and start-up time against the number of documents (1M, 10M, 100M by default).

For each size a corpus of short documents is generated (random words, ~50 tokens per document with the byte
tokenizer) and written in our format; then, each in a fresh process, the training loader is built and its first
batch taken: once with no index cache (the cache is built: the cost paid once per version of the data) and once
with it (what every later start, and every other rank, pays). Reported: peak RSS of that process above the same
process's RSS after importing torch and numpy (the loader's own memory), wall time to the first batch, and the
size of the index cache on disk.

    .venv/bin/python bench/bench_index.py                         # 1M, 10M, 100M documents under /tmp
    .venv/bin/python bench/bench_index.py --docs 1000000 --keep   # one size, keep the corpus
    .venv/bin/python bench/bench_index.py --make-text 10000000 /tmp/c10m   # only write text (for tools/tokenizer.py)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import numpy as np  # noqa: E402

WORDS = np.array([w.encode() for w in (
    "the of and to in is was for on that with as by at from his an were are which this be or had it not but "
    "one have their first after new two all also been its they has who other time into more years only over "
    "when most her some would there she between during about three later can city under world may many where "
    "school while while known such both then well being used through part these state since until year data "
    "model train token index memory rank order shuffle window block packed row epoch batch file folder").split()])


def make_text(n_docs: int, folder: str, files: int = 10, seed: int = 0, mean_words: int = 10) -> int:
    """`n_docs` lines of random words (about 50 bytes each) in `files` .txt files; returns the bytes written."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    total = 0
    per = -(-n_docs // files)
    for f in range(files):
        n = min(per, n_docs - f * per)
        if n <= 0:
            break
        with open(os.path.join(folder, f"part{f:03d}.txt"), "wb") as fh:
            for a in range(0, n, 200_000):
                m = min(200_000, n - a)
                counts = rng.integers(mean_words - 5, mean_words + 6, size=m)
                words = WORDS[rng.integers(0, len(WORDS), size=int(counts.sum()))]
                ends = np.cumsum(counts)
                lines, start = [], 0
                for e in ends.tolist():
                    lines.append(b" ".join(words[start:e].tolist()))
                    start = e
                data = b"\n".join(lines) + b"\n"
                fh.write(data)
                total += len(data)
    return total


def make_tokens(n_docs: int, folder: str, files: int = 10, seed: int = 0, mean: int = 50) -> int:
    """`n_docs` documents of random byte-tokenizer ids (lengths uniform around `mean`) in our format."""
    from internlm_core.data.formats import OursWriter

    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    per = -(-n_docs // files)
    tokens = 0
    for f in range(files):
        n = min(per, n_docs - f * per)
        if n <= 0:
            break
        w = OursWriter(os.path.join(folder, f"part{f:03d}.bin"), os.path.join(folder, f"part{f:03d}.bin.meta"), 259)
        for a in range(0, n, 1_000_000):
            lens = rng.integers(max(2, mean - 40), mean + 41, size=min(1_000_000, n - a))
            flat = rng.integers(0, 256, size=int(lens.sum()), dtype=np.int64)
            w.write_many(flat, lens)
            tokens += int(lens.sum())
        w.close()
    return tokens


PROBE = r"""
import json, os, sys, time
sys.path.insert(0, {root!r})
import numpy, torch
from internlm_core.config.schema import DataConfig
def status_kb(key):  # VmHWM, not ru_maxrss: that one keeps the parent's peak across fork and exec
    with open("/proc/self/status") as fh:
        return int(next(l for l in fh if l.startswith(key)).split()[1])
base = status_kb("VmRSS")
t0 = time.perf_counter()
from internlm_core.data import build_train_loader
cfg = DataConfig(seq_len=256, micro_bsz=2, packed_length=512, micro_num=2, seed=1, train_folder={folder!r},
                 index_cache_folder={cache!r})
ld = build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=512)
it = iter(ld)
next(it)
first = time.perf_counter() - t0
n, t1 = 0, time.perf_counter()
while time.perf_counter() - t1 < 2.0:
    n += next(it)["input_ids"].numel()
peak = status_kb("VmHWM")
print(json.dumps({{"base_mb": base / 1024, "peak_mb": peak / 1024, "first_batch_s": first,
                   "tokens_per_s": n / (time.perf_counter() - t1), "docs": ld.table.num_docs}}))
"""


def probe(folder: str, cache: str) -> dict:
    code = PROBE.format(root=str(ROOT), folder=folder, cache=cache)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"probe failed: {p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def du(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[1_000_000, 10_000_000, 100_000_000])
    ap.add_argument("--mean-tokens", type=int, default=50, help="mean tokens per document")
    ap.add_argument("--workdir", default=None, help="where corpora go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpora")
    ap.add_argument("--make-text", nargs=2, metavar=("N_DOCS", "FOLDER"), help="only write N_DOCS lines of text")
    args = ap.parse_args(argv)
    if args.make_text:
        t0 = time.perf_counter()
        n = make_text(int(args.make_text[0]), args.make_text[1])
        print(f"wrote {n / 1e6:.1f} MB of text in {time.perf_counter() - t0:.1f} s")
        return 0
    work = args.workdir or tempfile.mkdtemp(prefix="bench_index_")
    rows = []
    for n in args.docs:
        folder = os.path.join(work, f"docs{n}")
        cache = os.path.join(work, f"cache{n}")
        shutil.rmtree(cache, ignore_errors=True)
        if not os.path.isdir(folder):
            t0 = time.perf_counter()
            toks = make_tokens(n, folder, mean=args.mean_tokens)
            print(f"{n:,} documents, {toks:,} tokens written in {time.perf_counter() - t0:.1f} s", flush=True)
        cold = probe(folder, cache)
        warm = probe(folder, cache)
        rows.append((n, cold, warm, du(cache)))
        print(f"{n:,} documents: cold {cold}, warm {warm}", flush=True)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
    print()
    print("| documents | start-up, cache built (s) | start-up, cache present (s) | loader memory, cold (MB) | "
          "loader memory, warm (MB) | cache on disk (MB) | tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, cold, warm, size in rows:
        print(f"| {n:,} | {cold['first_batch_s']:.1f} | {warm['first_batch_s']:.2f} | "
              f"{cold['peak_mb'] - cold['base_mb']:.0f} | {warm['peak_mb'] - warm['base_mb']:.0f} | "
              f"{size / 1e6:.0f} | {warm['tokens_per_s']:,.0f} |")
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
