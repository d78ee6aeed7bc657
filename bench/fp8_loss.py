"""Low-precision training against bf16 on the demo corpus: 200 steps of configs/tiny.py (make demo's data and
settings: byte tokenizer, vocab 512, adam.lr 1e-3, warm-up cosine, one process), once per recipe, each from the same
seed. Prints the mean training loss of the last 20 steps, the final validation loss and each one's ratio to bf16's.

The check of issue 37: model.fp8's loss within 1.5% of bf16's after 200 steps. It takes a few minutes per run on two
CPU cores (float8 GEMMs run on torch._scaled_mm's CPU kernels; mxfp8 is emulated), so it is a benchmark, not a test.

    python bench/fp8_loss.py                       # bf16, tensorwise, rowwise
    python bench/fp8_loss.py --recipes tensorwise mxfp8 --reuse   # mxfp8 is emulated: ~3x the time
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.train_runs import write_table  # noqa: E402

LAST = 20


def demo_data(out: Path) -> tuple[Path, Path]:
    """make demo's corpus, tokenized with the byte tokenizer (built once into `out`)."""
    train, valid = out / "data/train", out / "data/valid"
    if not (train.exists() and valid.exists()):
        subprocess.run([sys.executable, "tools/make_demo_corpus.py", "--out", str(out / "corpus")], cwd=ROOT, check=True)
        for split, dest in (("train", train), ("valid", valid)):
            subprocess.run([sys.executable, "tools/tokenizer.py", "--text_input_path", str(out / "corpus" / split),
                            "--bin_output_path", str(dest), "--tokenizer", "byte"], cwd=ROOT, check=True)
    return train, valid


def run(out: Path, name: str, recipe: str, steps: int, train: Path, valid: Path, reuse: bool,
        extra: tuple[str, ...] = ("model.dtype=torch.bfloat16",)) -> dict:
    """One run (reused from `out` when it finished before and `reuse`); its last-20 mean training loss and its final
    validation loss (the mean of the code and docs sets'). `extra`: more overrides (bf16 compute by default)."""
    run_dir = out / "runs" / name
    sets = [f"data.train_folder={train}", f"data.valid_folder={valid}", "model.vocab_size=512", "tokenizer=byte",
            f"data.total_steps={steps}", f"data.valid_every={steps}", "monitor.log_every=20", "adam.lr=1e-3",
            "monitor.tensorboard=False", f"model.fp8={recipe}", *extra]
    metrics = run_dir / "metrics.jsonl"
    done = metrics.exists() and sum('"kind": "train"' in x for x in metrics.read_text().splitlines()) == steps
    if done and reuse:
        print(f"{name}: reusing {run_dir}")
    else:
        p = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.py", "--run-dir", str(run_dir),
                            "--set", *sets], cwd=ROOT, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{name} failed:\n{(p.stdout + p.stderr)[-3000:]}")
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("kind") == "train"]
    last_valid = [r for r in records if r.get("kind") == "valid"][-1]
    valid = [v for k, v in last_valid.items() if k.startswith("valid/") and k.endswith("/loss")]  # code, docs
    return {"name": name, "steps": len(losses), "train": sum(losses[-LAST:]) / LAST, "valid": sum(valid) / len(valid)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=ROOT / "build/bench_fp8_loss")
    ap.add_argument("--reuse", action="store_true", help="reuse the finished runs of an earlier invocation")
    a = ap.parse_args()
    train, valid = demo_data(a.out)
    results = [run(a.out, "bf16", "off", a.steps, train, valid, a.reuse)]
    results += [run(a.out, r, r, a.steps, train, valid, a.reuse) for r in a.recipes]
    base = results[0]
    rows = [f"| run ({a.steps} steps, demo corpus) | train loss, last {LAST} | ratio to bf16 | validation loss | ratio |",
            "|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r['name']} | {r['train']:.4f} | {r['train'] / base['train']:.4f} | {r['valid']:.4f} | "
                    f"{r['valid'] / base['valid']:.4f} |")
    write_table(a.out, rows)


if __name__ == "__main__":
    main()
