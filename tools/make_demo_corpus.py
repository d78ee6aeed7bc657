#!/usr/bin/env python
"""Write a demo corpus from Python's standard library, which exists on every machine with Python.

Two kinds of documents, one subfolder each (so that they become two dataset types when tokenized):
- ``code``: the source of the library's modules (one document per file, tests and site-packages left out);
- ``docs``: the docstrings of its modules, classes and functions.

There is no CJK kind: the only CJK prose the standard library ships is the sample text of
``test/cjkencodings/*-utf8.txt``, 37 distinct lines (3.4 KB, 921 CJK characters), too little both to train on and
to hold out the 2,000 tokens a validation set needs to mean something.

Output: ``OUT/train/<kind>/stdlib.jsonl`` and ``OUT/valid/<kind>/stdlib.jsonl``, records ``{"text", "source"}``.
The validation split is chosen by a hash of the source (about `--valid-percent` % of the modules, at most
`--valid-max-kb` KB per kind), so it is the same on every run and no module is in both splits. A kind whose
validation text would be under `--valid-min-kb` KB (2 KB: 2,000 byte tokens) is an error. Then::

    python tools/make_demo_corpus.py --output data/demo/raw
    python tools/tokenizer.py --input data/demo/raw/train --output data/demo/bin/train --tokenizer byte
    python tools/tokenizer.py --input data/demo/raw/valid --output data/demo/bin/valid --tokenizer byte
    # data.train_folder = "data/demo/bin/train", data.valid_folder = "data/demo/bin/valid", model.vocab_size >= 259
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}


def _bucket(key: str) -> float:
    """A stable number in [0, 100) from a string."""
    return int(hashlib.md5(key.encode()).hexdigest()[:8], 16) % 10000 / 100.0


def source_files(stdlib: Path) -> list[Path]:
    out = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        out.extend(Path(root) / f for f in sorted(files) if f.endswith(".py"))
    return out


def docstrings(tree: ast.AST, module: str):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                name = module if isinstance(node, ast.Module) else f"{module}.{node.name}"
                yield doc, name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="data/demo/raw", help="output folder (default data/demo/raw)")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="the standard library folder")
    p.add_argument("--valid-percent", type=float, default=3.0, help="share of modules held out for validation")
    p.add_argument("--valid-max-kb", type=float, default=16.0,
                   help="at most this many KB of validation text per kind (keeps validation quick; 0: no limit)")
    p.add_argument("--valid-min-kb", type=float, default=2.0,
                   help="fail when a kind has less validation text than this many KB (default 2: 2,000 byte tokens)")
    p.add_argument("--max-code-mb", type=float, default=0.0,
                   help="keep at most this many MB of source code (0: all; a stable hash order chooses the files)")
    args = p.parse_args(argv)
    stdlib = Path(args.stdlib)
    if not stdlib.is_dir():
        print(f"error: --stdlib {stdlib}: no such folder", file=sys.stderr)
        return 1
    t0 = time.perf_counter()
    out = Path(args.output)
    handles = {}

    def emit(split, kind, text, source):
        key = (split, kind)
        if split == "valid" and args.valid_max_kb > 0 and key in counts and \
                counts[key][1] + len(text.encode("utf-8")) > args.valid_max_kb * 1e3:
            return  # held out, but beyond the validation budget: in neither split
        if key not in handles:
            d = out / split / kind
            d.mkdir(parents=True, exist_ok=True)
            handles[key] = open(d / "stdlib.jsonl.tmp", "w", encoding="utf-8")
            counts[key] = [0, 0]
        handles[key].write(json.dumps({"text": text, "source": source}, ensure_ascii=False) + "\n")
        counts[key][0] += 1
        counts[key][1] += len(text.encode("utf-8"))

    counts: dict = {}
    files = source_files(stdlib)
    if args.max_code_mb > 0:
        files.sort(key=lambda f: _bucket(str(f.relative_to(stdlib))))
    budget = args.max_code_mb * 1e6 if args.max_code_mb > 0 else float("inf")
    used = 0
    for f in files:
        rel = str(f.relative_to(stdlib))
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        if used + len(text) > budget:
            continue
        used += len(text)
        split = "valid" if _bucket(rel) < args.valid_percent else "train"
        emit(split, "code", text, rel)
        module = rel[:-3].replace(os.sep, ".").removesuffix(".__init__")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for doc, name in docstrings(tree, module):
            emit(split, "docs", doc, name)
    for (split, kind), fh in handles.items():
        fh.close()
        os.replace(out / split / kind / "stdlib.jsonl.tmp", out / split / kind / "stdlib.jsonl")
    if not counts:
        print(f"error: {stdlib}: no Python sources found", file=sys.stderr)
        return 1
    for kind in sorted({k for _, k in counts}):
        held = counts.get(("valid", kind), [0, 0])[1]
        if held < args.valid_min_kb * 1e3:
            print(f"error: validation text of kind {kind!r}: {held} bytes, expected at least "
                  f"{args.valid_min_kb * 1e3:.0f} (--valid-min-kb); raise --valid-percent", file=sys.stderr)
            return 1
    for (split, kind), (n, b) in sorted(counts.items()):
        print(f"{split:5s} {kind:4s}: {n:6d} documents, {b / 1e6:6.2f} MB -> {out / split / kind / 'stdlib.jsonl'}")
    print(f"demo corpus from {stdlib} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
