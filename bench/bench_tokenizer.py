#!/usr/bin/env python
"""Tokenizer throughput (input MB/s): our tools/tokenizer.py against InternLM's, same jsonl corpus and model.

InternLM's tools/tokenizer.py is not part of this repository: point `--internlm` (or env INTERNLM_TOKENIZER) at a
local copy of it (InternLM/InternLM, commit aaaf4d7; its folder must hold `transformers/tokenization_internlm.py`).
It needs the `transformers` package: give `--peer-pythonpath` (or env INTERNLM_PEER_PYTHONPATH) for a folder where
it is installed, e.g. ``pip install --target /tmp/peer_pkgs transformers==4.40.2``. Without them that row says
"skipped". The peer script is run unmodified from a temporary copy of its folder in which `V7_sft.model` is our
`--model`, so both sides use the same SentencePiece model.

Every tool runs as a subprocess on the same input; a run on a one-line file measures its start-up (imports, model
load), reported separately, and "MB/s" is measured over the whole run (start-up included), "steady MB/s" without it.
Both processes are pinned to the same `--cpus` (default: 2 CPUs).

Before timing anything, the InternLM-compatible mode (`--format internlm --internlm-compat`, BOS and EOS on, as
InternLM's tool writes them) must reproduce, byte for byte, the files InternLM's tool made from the fixture corpus
(../shared/fixtures/internlm/corpus_{txt,json,jsonl}.bin and .meta); with the peer, also its output on the timed
corpus. Any difference is an error: the first differing byte and document are printed and the exit status is 1.
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
FIX = ROOT.parent / "shared" / "fixtures" / "internlm"


def make_corpus(path: Path, mb: float) -> None:
    """A jsonl corpus of about `mb` MB: the fixture corpus's records (docstrings, CJK text) repeated."""
    lines = (FIX / "corpus.jsonl").read_bytes().splitlines(keepends=True)
    out, size, i = [], 0, 0
    while size < mb * 1e6:
        rec = json.loads(lines[i % len(lines)])
        rec["id"] = i
        line = (json.dumps(rec, ensure_ascii=False) + "\n").encode()
        out.append(line)
        size += len(line)
        i += 1
    path.write_bytes(b"".join(out))


def first_difference(ours: Path, theirs: Path) -> str:
    """'' when the two files are byte-identical, else where they first differ (byte, line = document)."""
    a, b = ours.read_bytes(), theirs.read_bytes()
    if a == b:
        return ""
    n = min(len(a), len(b))
    i = next((k for k in range(n) if a[k] != b[k]), n)
    line = a.count(b"\n", 0, i) + 1
    where = f"byte {i} (line {line})" if i < n else f"length {len(a)} vs {len(b)} bytes"
    return f"{ours.name} differs from {theirs} at {where}"


def compare_outputs(ours: Path, theirs: Path) -> list[str]:
    """Differences of the .bin and its .meta (empty when both are identical)."""
    diffs = [first_difference(ours, theirs),
             first_difference(Path(str(ours) + ".meta"), Path(str(theirs) + ".meta"))]
    return [d for d in diffs if d]


def timed(cmd, env=None, cpus=None) -> float:
    if cpus:
        cmd = ["taskset", "-c", cpus, *cmd]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{p.stderr[-2000:]}")
    return dt


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", help="a jsonl corpus (default: build one of --mb MB from the fixtures)")
    p.add_argument("--mb", type=float, default=8.0)
    p.add_argument("--model", default=str(FIX / "V7_sft.model"), help="SentencePiece model (both tools)")
    p.add_argument("--internlm", default=os.environ.get("INTERNLM_TOKENIZER"),
                   help="path to InternLM's tools/tokenizer.py (env INTERNLM_TOKENIZER)")
    p.add_argument("--peer-pythonpath", default=os.environ.get("INTERNLM_PEER_PYTHONPATH", ""),
                   help="PYTHONPATH giving the peer `transformers` (env INTERNLM_PEER_PYTHONPATH)")
    p.add_argument("--cpus", default="0,1", help="CPU list for taskset (default 0,1: 2 cores); '' to not pin")
    p.add_argument("--repeat", type=int, default=1, help="runs per row (the best is reported)")
    args = p.parse_args(argv)
    if args.cpus and not shutil.which("taskset"):
        args.cpus = ""
    ncpu = len(args.cpus.split(",")) if args.cpus else (os.cpu_count() or 1)

    tmp = Path(tempfile.mkdtemp(prefix="bench_tok_"))
    try:
        corpus = Path(args.corpus) if args.corpus else tmp / "corpus.jsonl"
        if not args.corpus:
            make_corpus(corpus, args.mb)
        tiny = tmp / "tiny.jsonl"
        tiny.write_bytes(corpus.read_bytes().split(b"\n", 1)[0] + b"\n")
        mb = corpus.stat().st_size / 1e6
        ours = [sys.executable, str(ROOT / "tools" / "tokenizer.py"), "--quiet", "--tokenizer", args.model]
        compat = ["--format", "internlm", "--internlm-compat"]  # BOS and EOS on, as InternLM's tool writes them
        errors, checks = [], []
        if Path(args.model).resolve() == (FIX / "V7_sft.model").resolve():
            for fmt in ("txt", "json", "jsonl"):  # InternLM's own output on the fixture corpus, byte for byte
                out = tmp / f"fixture_{fmt}.bin"
                timed(ours + ["--input", str(FIX / f"corpus.{fmt}"), "--output", str(out), "--workers", "1",
                              *compat])
                diffs = compare_outputs(out, FIX / f"corpus_{fmt}.bin")
                errors += diffs
                checks.append(f"corpus.{fmt} {'identical' if not diffs else 'DIFFERENT'}")
        else:
            checks.append("skipped (--model is not the fixtures' V7_sft.model)")
        rows = []

        def bench(name, make_cmd, env=None):
            startup = min(timed(make_cmd(tiny, tmp / "s.bin"), env, args.cpus) for _ in range(args.repeat))
            total = []
            for _ in range(args.repeat):
                out = tmp / f"{len(rows)}.bin"
                for f in (out, Path(str(out) + ".meta")):
                    f.unlink(missing_ok=True)
                total.append(timed(make_cmd(corpus, out), env, args.cpus))
            t = min(total)
            rows.append((name, t, startup, mb / t, mb / max(t - startup, 1e-9)))
            return tmp / f"{len(rows) - 1}.bin"

        for w in (1, ncpu):
            bench(f"ours, format ours, {w} worker(s)",
                  lambda i, o, w=w: ours + ["--input", str(i), "--output", str(o), "--workers", str(w)])
        ours_compat = bench(f"ours, InternLM-compat, format internlm, {ncpu} workers",
                            lambda i, o: ours + ["--input", str(i), "--output", str(o), "--workers", str(ncpu),
                                                 *compat])
        peer_note = ""
        if args.internlm and Path(args.internlm).is_file():
            peer_dir = tmp / "internlm_tools"
            shutil.copytree(Path(args.internlm).parent / "transformers", peer_dir / "transformers")
            shutil.copy(args.internlm, peer_dir / "tokenizer.py")
            os.symlink(os.path.abspath(args.model), peer_dir / "V7_sft.model")
            env = dict(os.environ)
            if args.peer_pythonpath:
                env["PYTHONPATH"] = args.peer_pythonpath + os.pathsep + env.get("PYTHONPATH", "")
            try:
                peer_out = bench("InternLM tools/tokenizer.py (aaaf4d7)",
                                 lambda i, o: [sys.executable, str(peer_dir / "tokenizer.py"), "--text_input_path",
                                               str(i), "--bin_output_path", str(o)], env)
                diffs = compare_outputs(ours_compat, peer_out)
                errors += diffs
                peer_note = ("InternLM-compat output on the timed corpus identical to InternLM's (bin and meta): "
                             + ("yes" if not diffs else "NO"))
            except RuntimeError as e:
                rows.append(("InternLM tools/tokenizer.py", None, None, None, None))
                peer_note = f"InternLM's tokenizer failed: {str(e).splitlines()[-1]}"
        else:
            rows.append(("InternLM tools/tokenizer.py", None, None, None, None))
            peer_note = "InternLM's tokenizer skipped: pass --internlm PATH (or INTERNLM_TOKENIZER) to a local copy"

        print(f"corpus: {corpus} ({mb:.1f} MB jsonl), model {args.model}, CPUs: {args.cpus or 'all'}")
        print(f"{'tool':62s} {'seconds':>8s} {'start-up':>8s} {'MB/s':>7s} {'steady MB/s':>12s}")
        for name, t, s, r, rs in rows:
            if t is None:
                print(f"{name:62s} {'skipped':>8s}")
            else:
                print(f"{name:62s} {t:8.2f} {s:8.2f} {r:7.2f} {rs:12.2f}")
        peer = [r for r in rows if r[0].startswith("InternLM") and r[1] is not None]
        if peer:
            _, _, _, pr, prs = peer[0]
            for name, t, s, r, rs in rows:
                if t is not None and not name.startswith("InternLM"):
                    print(f"ratio to InternLM  {name:44s} {r / pr:6.1f}x  (steady {rs / prs:.1f}x)")
        print(peer_note)
        print(f"InternLM-compat output against InternLM's files of the fixture corpus: {', '.join(checks)}")
        if errors:
            print("error: the InternLM-compatible tokenizer output is not byte-identical to InternLM's:",
                  file=sys.stderr)
            for e in errors:
                print(f"  {e}", file=sys.stderr)
            return 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
