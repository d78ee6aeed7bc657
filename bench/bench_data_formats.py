#!/usr/bin/env python
"""Training-loader tokens/s for every data format: pre-tokenized (ours, InternLM's, Megatron's .bin/.idx) and
streaming (jsonl, parquet, a Hugging Face datasets folder) tokenized on the fly, from the same documents.

Documents: random words, about 50 bytes each (the byte tokenizer: one token per byte plus BOS and EOS), as
bench_index.py makes them. Each loader is iterated in the calling thread for `--seconds` (prefetch off), for the
batch shapes of configs/tiny.py and of a 7B-style run (seq_len 2048, micro_bsz 1, micro_num 4); tokens/s counts the
packed input tokens delivered. The last column is the ratio to our pre-tokenized format.

    .venv/bin/python bench/bench_data_formats.py                 # 200,000 documents, 3 s per loader
    .venv/bin/python bench/bench_data_formats.py --docs 50000 --seconds 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from bench_index import make_text  # noqa: E402

from internlm_core.config.schema import DataConfig  # noqa: E402
from internlm_core.data import build_train_loader  # noqa: E402
from internlm_core.data.text2bin import Options, tokenize_paths  # noqa: E402
from internlm_core.data.tokenizers import load_tokenizer  # noqa: E402

SHAPES = {"tiny": dict(seq_len=256, micro_bsz=2, micro_num=2), "7B-style": dict(seq_len=2048, micro_bsz=1, micro_num=4)}


def prepare(work: str, n_docs: int) -> dict:
    """{format: (train_folder, extra config)} for every format, from one text corpus."""
    text = os.path.join(work, "text")
    make_text(n_docs, text, files=2)
    lines = []
    for f in sorted(os.listdir(text)):
        with open(os.path.join(text, f)) as fh:
            lines.extend(line.rstrip("\n") for line in fh)
    jsonl = os.path.join(work, "jsonl", "web")
    os.makedirs(jsonl)
    with open(os.path.join(jsonl, "part0.jsonl"), "w") as fh:
        for t in lines:
            fh.write(json.dumps({"text": t}) + "\n")
    out = {}
    tok = load_tokenizer("byte")
    for fmt in ("ours", "internlm", "megatron"):
        dst = os.path.join(work, fmt, "web")
        tokenize_paths(os.path.join(jsonl, "part0.jsonl"), os.path.join(dst, "part0.bin"), tok, Options(fmt=fmt),
                       progress_bar=False)
        out[fmt] = (os.path.join(work, fmt), {})
    out["streaming jsonl"] = (os.path.join(work, "jsonl"), dict(type="streaming", tokenizer_path="byte"))
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pqdir = os.path.join(work, "parquet", "web")
        os.makedirs(pqdir)
        table = pa.table({"text": lines})
        pq.write_table(table, os.path.join(pqdir, "part0.parquet"), row_group_size=10_000)
        out["streaming parquet"] = (os.path.join(work, "parquet"), dict(type="streaming", tokenizer_path="byte"))
        hf = os.path.join(work, "hf", "web")
        os.makedirs(hf)
        with pa.OSFile(os.path.join(hf, "data-00000-of-00001.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as w:
                for b in table.to_batches(max_chunksize=1000):
                    w.write_batch(b)
        with open(os.path.join(hf, "state.json"), "w") as fh:
            json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, fh)
        out["streaming HF datasets folder"] = (os.path.join(work, "hf"), dict(type="streaming", tokenizer_path="byte"))
    except ImportError:
        print("(pyarrow not installed: no parquet / Hugging Face folder rows)")
    return out


def speed(folder: str, extra: dict, shape: dict, seconds: float) -> tuple[float, float]:
    cfg = DataConfig(train_folder=folder, seed=1, packed_length=shape["seq_len"] * shape["micro_bsz"], **shape, **extra)
    t0 = time.perf_counter()
    it = iter(build_train_loader(cfg, dp_rank=0, dp_size=1, vocab_size=259))
    next(it)
    first = time.perf_counter() - t0
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(5):
            n += next(it)["input_ids"].numel()
    return n / (time.perf_counter() - t0), first


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=200_000)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench_formats_")
    try:
        t0 = time.perf_counter()
        formats = prepare(work, args.docs)
        print(f"{args.docs:,} documents in every format in {time.perf_counter() - t0:.1f} s")
        rows = []
        for name, (folder, extra) in formats.items():
            for shape_name, shape in SHAPES.items():
                tps, first = speed(folder, extra, shape, args.seconds)
                rows.append((name, shape_name, tps, first))
                print(f"{name:30s} {shape_name:9s} {tps:>12,.0f} tokens/s  first batch {first:.2f} s", flush=True)
        base = {s: tps for n, s, tps, _ in rows if n == "ours"}
        print()
        print("| format | batch shape | tokens/s | first batch (s) | / ours |")
        print("| --- | --- | --- | --- | --- |")
        for name, shape_name, tps, first in rows:
            print(f"| {name} | {shape_name} | {tps:,.0f} | {first:.2f} | {tps / base[shape_name]:.2f}x |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
