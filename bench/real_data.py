#!/usr/bin/env python
"""Real documents of varying length: internlm-core (packed, document-masked attention) against the HF Trainer's
three usual recipes, on two corpora built from Python's standard library.

Corpora (every .py file of the standard library except site-packages; tests included):
- short: every docstring (module, class, function; ast.get_docstring), about 11,000 documents, median ~70 bytes;
- long: every source file, about 1,800 documents, median ~6,500 bytes.
Tokenizer: the built-in byte tokenizer for everyone (UTF-8 bytes, BOS 256 + bytes + EOS 257 per document, as
tools/tokenizer.py writes them); model: the peers' workload shape with vocab_size 512 (>= 259 byte ids).

Systems, each for a fixed number of optimizer steps of micro batch 4 x seq_len 512 (2048 token slots):
- internlm_core: `train.py --config configs/bench_cpu.py` on the tokenized .bin folder: documents packed into
  rows, attention within each document only (cu_seqlens); every token of the corpus is trained (but the last
  partial row of an epoch).
- hf_padding: HF Trainer, one document per sequence truncated to seq_len, padded to the longest of its batch
  (a DataCollatorForLanguageModeling-style collator: attention_mask, labels -100 on padding), sequential order.
- hf_group_by_length: the same with train_sampling_strategy="group_by_length" (LengthGroupedSampler).
- hf_chunking: run_clm's group_texts: all documents concatenated and cut into seq_len blocks (the remainder
  dropped); no padding, attention crosses document boundaries.

Reported: useful tokens/s (non-padding input tokens of the timed steps / their wall time; steps after the first
SKIP), padding share of the token slots, the fraction of the corpus's tokens that one epoch of the recipe trains
on (truncation discards text), the fraction of attended (query, key) pairs that cross a document boundary.
For internlm_core the loader's rows of the timed steps are checked: no cu_seqlens segment holds a document end
(EOS) anywhere but at its last token, i.e. no attention segment spans two documents.

    python bench/real_data.py [--out DIR] [--mode fp32|bf16] [--corpora short,long]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PEERS_DIR = Path(os.environ.get("PEERS_DIR", ROOT.parent / "shared" / "bench" / "peers"))

SEQ_LEN, MICRO_BATCH, VOCAB = 512, 4, 512
BOS, EOS, PAD = 256, 257, 258
SKIP = 5
STEPS = {"short": 65, "long": 35}
RECIPES = ("hf_padding", "hf_group_by_length", "hf_chunking")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


# ---- corpora --------------------------------------------------------------------------------------------

def stdlib_texts(stdlib: Path) -> tuple[list[str], list[str]]:
    """(docstrings, source files) of every .py under the standard library, except site-packages."""
    docs, sources = [], []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__", "dist-packages"))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            try:
                text = (Path(root) / f).read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            sources.append(text)
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    d = ast.get_docstring(node)
                    if d:
                        docs.append(d)
    return docs, sources


def prepare(out: Path) -> dict:
    """Write out/corpus/<name>/stdlib.jsonl and tokenize it with tools/tokenizer.py into out/bin/<name>."""
    docs, sources = stdlib_texts(Path(sysconfig.get_paths()["stdlib"]))
    info = {}
    for name, texts in (("short", docs), ("long", sources)):
        d = out / "corpus" / name
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "stdlib.jsonl", "w", encoding="utf-8") as fh:
            for t in texts:
                fh.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
        lengths = [len(t.encode("utf-8")) + 2 for t in texts]
        subprocess.check_call([sys.executable, str(ROOT / "tools" / "tokenizer.py"), "--input", str(d / "stdlib.jsonl"),
                               "--output", str(out / "bin" / name / "stdlib.bin"), "--tokenizer", "byte", "--quiet"],
                              cwd=ROOT, stdout=subprocess.DEVNULL)
        info[name] = dict(documents=len(texts), tokens=sum(lengths),
                          median_bytes=statistics.median(len(t.encode("utf-8")) for t in texts))
    (out / "corpora.json").write_text(json.dumps(info, indent=1))
    return info


def load_docs(out: Path, name: str) -> list[list[int]]:
    docs = []
    with open(out / "corpus" / name / "stdlib.jsonl", encoding="utf-8") as fh:
        for line in fh:
            docs.append([BOS, *json.loads(line)["text"].encode("utf-8"), EOS])
    return docs


def cross_document_pairs(block) -> tuple[int, int]:
    """(causal (query, key) pairs, of them crossing a document boundary) in one block of token ids; a document
    ends after each EOS."""
    T = len(block)
    total = T * (T + 1) // 2
    same, start = 0, 0
    for i, t in enumerate(block):
        if t == EOS or i == T - 1:
            n = i + 1 - start
            same += n * (n + 1) // 2
            start = i + 1
    return total, total - same


# ---- the HF Trainer recipes (run in a subprocess each) -------------------------------------------------

def run_hf(recipe: str, corpus: str, data_dir: Path, out: Path, steps: int, mode: str) -> None:
    sys.path.insert(0, str(PEERS_DIR))
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import workload as W

    docs = load_docs(data_dir, corpus)
    total_tokens = sum(len(d) for d in docs)
    record: dict = {"useful": [], "slots": []}

    if recipe == "hf_chunking":
        flat = np.fromiter((t for d in docs for t in d), dtype=np.int64, count=total_tokens)
        n_blocks = len(flat) // SEQ_LEN
        blocks = torch.from_numpy(flat[: n_blocks * SEQ_LEN].reshape(n_blocks, SEQ_LEN))
        trained_fraction = n_blocks * SEQ_LEN / total_tokens
        pairs = [cross_document_pairs(b) for b in blocks[: 2000].tolist()]  # first 2000 blocks of the corpus

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return n_blocks

            def __getitem__(self, i):
                return {"input_ids": blocks[i], "labels": blocks[i]}

        def collate(features):
            x = torch.stack([f["input_ids"] for f in features])
            record["useful"].append(x.numel())
            record["slots"].append(x.numel())
            return {"input_ids": x, "labels": x.clone()}
        cross = sum(p[1] for p in pairs) / sum(p[0] for p in pairs)
    else:
        trained_fraction = sum(min(len(d), SEQ_LEN) for d in docs) / total_tokens
        cross = 0.0

        class Data(torch.utils.data.Dataset):
            def __len__(self):
                return len(docs)

            def __getitem__(self, i):
                return {"input_ids": docs[i][:SEQ_LEN]}  # tokenizer(..., truncation=True, max_length=seq_len)

        def collate(features):
            """Pad to the longest sequence of the batch; labels = input_ids with -100 on padding (what
            DataCollatorForLanguageModeling(mlm=False) returns, with attention_mask)."""
            n = max(len(f["input_ids"]) for f in features)
            x = torch.full((len(features), n), PAD, dtype=torch.long)
            mask = torch.zeros((len(features), n), dtype=torch.long)
            for i, f in enumerate(features):
                x[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
                mask[i, : len(f["input_ids"])] = 1
            labels = x.masked_fill(mask == 0, -100)
            record["useful"].append(int(mask.sum()))
            record["slots"].append(x.numel())
            return {"input_ids": x, "attention_mask": mask, "labels": labels}

    times: list[float] = []
    snaps = []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter())
            if len(times) in (SKIP, steps):
                snaps.append(W.cpu_snapshot())

    config = W.hf_config()
    config.vocab_size = VOCAB
    torch.manual_seed(W.INIT_SEED)
    model = LlamaForCausalLM(config)
    import tempfile
    tmp = tempfile.TemporaryDirectory(prefix="hf_real_")
    args = TrainingArguments(
        output_dir=tmp.name, per_device_train_batch_size=MICRO_BATCH, max_steps=steps, logging_steps=5,
        save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0, learning_rate=W.LR,
        adam_beta1=W.BETAS[0], adam_beta2=W.BETAS[1], adam_epsilon=W.EPS, weight_decay=W.WD, max_grad_norm=W.CLIP,
        lr_scheduler_type="cosine", warmup_steps=int(steps * W.LR_WARMUP / W.STEPS), optim="adamw_torch_fused",
        train_sampling_strategy="group_by_length" if recipe == "hf_group_by_length" else "sequential",
        bf16=mode == "bf16")
    Trainer(model=model, args=args, train_dataset=Data(), data_collator=collate, callbacks=[Timer()]).train()
    if len(times) != steps:
        raise RuntimeError(f"{recipe}: {len(times)} steps recorded, expected {steps}")
    window = times[-1] - times[SKIP - 1]
    useful = sum(record["useful"][SKIP:steps])
    slots = sum(record["slots"][SKIP:steps])
    dts = [b - a for a, b in zip(times[SKIP - 1:-1], times[SKIP:])]
    res = dict(system=recipe, corpus=corpus, mode=mode, steps=steps, timed_steps=f"{SKIP + 1}..{steps}",
               useful_tok_s=useful / window, slot_tok_s=slots / window, padding=1 - useful / slots,
               trained_fraction=trained_fraction, cross_doc=cross, step_ms_median=1e3 * statistics.median(dts),
               other_load=W.other_load(*snaps), useful_tokens=useful, window_s=window)
    W.write_json(str(out), f"{corpus}_{recipe}", res)
    print(f"{corpus} {recipe}: {res['useful_tok_s']:.0f} useful tok/s, padding {res['padding']:.1%}, "
          f"trained {trained_fraction:.1%} of the corpus, cross-document pairs {cross:.1%}")


# ---- internlm-core -------------------------------------------------------------------------------------

def check_no_cross_document(config: str, overrides: list[str], steps: int) -> tuple[float, int]:
    """Rebuild the run's train loader (same config, same seed: the same batches) and check its rows: EOS only
    at the last token of a cu_seqlens segment, BOS only at the first. Returns (fraction of the corpus's tokens
    in an epoch's rows, segments checked)."""
    import numpy as np

    from internlm_core.config import load_config
    from internlm_core.data import build_train_loader

    cfg = load_config(config, overrides)
    loader = build_train_loader(cfg.data, dp_rank=0, dp_size=1, vocab_size=cfg.model.vocab_size)
    it = iter(loader)
    segments = 0
    for _ in range(steps):
        b = next(it)
        for row, cu in zip(b["input_ids"], b["cu_seqlens"]):
            ids = row.numpy()
            cu = cu.numpy()
            for a, e in zip(cu[:-1], cu[1:]):
                seg = ids[a:e]
                if (seg[:-1] == EOS).any() or (seg[1:] == BOS).any():
                    raise AssertionError(f"a cu_seqlens segment [{a}, {e}) spans a document boundary")
                segments += 1
    fraction = loader.rows_per_epoch * loader.packed_length / loader.table.num_tokens
    assert np.isfinite(fraction)
    return fraction, segments


def run_ours(corpus: str, data_dir: Path, out: Path, steps: int, mode: str) -> dict:
    sys.path.insert(0, str(HERE))
    import internlm as ours

    config = "configs/bench_cpu.py"
    overrides = [f"data.train_folder={data_dir / 'bin' / corpus}", f"model.vocab_size={VOCAB}", "tokenizer=byte",
                 f"data.total_steps={steps}"]
    r = ours.run(mode, out, config, overrides, name=f"{corpus}_internlm_core", steps=steps, skip=SKIP)
    fraction, segments = check_no_cross_document(str(ROOT / config), overrides, steps)
    window = sum(r["step_ms"]) / 1e3
    tokens = r["tokens_per_step"] * (steps - SKIP)
    res = dict(system="internlm_core", corpus=corpus, mode=mode, steps=steps, timed_steps=r["timed_steps"],
               useful_tok_s=tokens / window, slot_tok_s=tokens / window, padding=0.0, trained_fraction=fraction,
               cross_doc=0.0, segments_checked=segments, step_ms_median=r["step_ms_median"],
               other_load=r["other_load"], useful_tokens=tokens, window_s=window)
    (out / f"{corpus}_internlm_core.json").write_text(json.dumps(res, indent=1))
    print(f"{corpus} internlm_core: {res['useful_tok_s']:.0f} useful tok/s, trained {fraction:.2%} of the corpus, "
          f"{segments} attention segments checked: none spans two documents")
    return res


# ---- table ---------------------------------------------------------------------------------------------

def table(out: Path, corpora: list[str]) -> str:
    info = json.loads((out / "corpora.json").read_text())
    lines = ["real documents (byte tokenizer, vocab 512, micro batch 4 x 512; useful = non-padding tokens/s over "
             "the timed steps)"]
    for c in corpora:
        i = info[c]
        lines.append(f"  {c}: {i['documents']:,} documents, {i['tokens']:,} tokens, median {i['median_bytes']:.0f} bytes")
    head = f"{'corpus':<6} {'system':<19} {'useful tok/s':>12} {'padding':>8} {'corpus trained':>14} " \
           f"{'cross-doc attn':>14} {'step ms':>8} {'other load':>10}"
    lines += ["", head, "-" * len(head)]
    ratios, loads = [], []
    for c in corpora:
        rows = {}
        for s in ("internlm_core", *RECIPES):
            f = out / f"{c}_{s}.json"
            if f.exists():
                rows[s] = json.loads(f.read_text())
        for s, r in rows.items():
            loads.append(r["other_load"] or 0.0)
            lines.append(f"{c:<6} {s:<19} {r['useful_tok_s']:12.0f} {r['padding']:8.1%} {r['trained_fraction']:14.1%} "
                         f"{r['cross_doc']:14.1%} {r['step_ms_median']:8.1f} {r['other_load'] or 0:10.2f}")
        me = rows.get("internlm_core")
        hf = {s: r for s, r in rows.items() if s != "internlm_core"}
        if me and hf:
            best = max(hf.values(), key=lambda r: r["useful_tok_s"])
            q = me["useful_tok_s"] / best["useful_tok_s"]
            ratios.append(f"  {c}: internlm-core / best HF recipe ({best['system']}): {q:.2f}x  target >= 1.00  "
                          f"{'met' if q >= 1.0 else 'MISSED'}")
            if "hf_padding" in hf and c == "short":
                q = me["useful_tok_s"] / hf["hf_padding"]["useful_tok_s"]
                ratios.append(f"  {c}: internlm-core / hf_padding: {q:.2f}x  target >= 1.50  "
                              f"{'met' if q >= 1.5 else 'MISSED'}")
    lines += ["", "ratios (useful tokens/s)"] + ratios
    if loads and max(loads) > 0.05:
        lines.append(f"WARNING: other load up to {max(loads):.2f} cores during timing: rerun when idle")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / ("real-" + time.strftime("%Y%m%d-%H%M%S"))))
    p.add_argument("--mode", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--corpora", default="short,long")
    p.add_argument("--systems", default=",".join(("internlm_core",) + RECIPES))
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default {STEPS}; timed after {SKIP})")
    p.add_argument("--table", action="store_true", help="only print the table of --out")
    p.add_argument("--hf", nargs=4, metavar=("RECIPE", "CORPUS", "STEPS", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    out = Path(a.out).resolve()
    corpora = [c for c in a.corpora.split(",") if c]
    if a.hf:
        recipe, corpus, steps, res_dir = a.hf
        run_hf(recipe, corpus, out, Path(res_dir), int(steps), a.mode)
        return 0
    if a.table:
        print(table(out, corpora))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "corpora.json").exists():
        print(f"building the corpora in {out} ...", flush=True)
        prepare(out)
    systems = a.systems.split(",")
    if a.steps:
        STEPS.update({c: a.steps for c in STEPS})
    for c in corpora:
        for s in systems:
            print(f"== real documents: {c} {s}", flush=True)
            if s == "internlm_core":
                run_ours(c, out, out / "runs", STEPS[c], a.mode)
                os.replace(out / "runs" / f"{c}_internlm_core.json", out / f"{c}_internlm_core.json")
            else:
                with open(out / f"{c}_{s}.log", "w") as log:
                    rc = subprocess.call([sys.executable, str(Path(__file__).resolve()), "--out", str(out), "--mode", a.mode,
                                          "--hf", s, c, str(STEPS[c]), str(out)],
                                         cwd=PEERS_DIR, env=ENV, stdout=log, stderr=subprocess.STDOUT)
                text = (out / f"{c}_{s}.log").read_text().splitlines()
                if rc != 0:
                    print("\n".join(text[-30:]))
                    raise SystemExit(f"{s} on {c} failed ({rc})")
                print(text[-1] if text else "")
    text = table(out, corpora)
    (out / "table.txt").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
