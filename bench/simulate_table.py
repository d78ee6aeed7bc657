#!/usr/bin/env python
"""One rank of large jobs on this machine: the estimator's CPU prediction against a simulated run, side by side.

For each case (7B on 8 ranks, 20B on 64, 70B on 256, Mixtral-8x7B on 64, each in a layout the estimator gives; short sequences so
that the rank's compute takes minutes on a CPU), it runs `tools/estimate.py --device cpu --json` and
`train.py --simulate WORLD` (rank 0, `data.total_steps` 2), then prints one table: parameters the rank holds,
the estimator's total, the simulated peak (memory_report.json), their ratio, and the wall time. A case whose
share does not fit in this machine's memory is reported as refused, with what it needs.

    python bench/simulate_table.py [--out build/simulate_table] [--cases 7B@8,20B@64,70B@256,mixtral@64]

Slow by design: the 70B case materializes and trains ~2.2 B parameters of one stage on the CPU (about 15
minutes on 2 cores); the cases run one after the other. Results: <out>/<case>/ (run folders) and <out>/table.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30

# the simulated shape of every case: bf16, no activation recomputation, 4 micro-batches of one 128-token row
COMMON = ["data.seq_len=128", "data.micro_bsz=1", "data.micro_num=4", "model.dtype=torch.bfloat16",
          "model.checkpoint=False"]
CASES = {
    "7B@8": ("configs/7B.py", 8, ["parallel.zero1=-1", "parallel.tensor=2", "parallel.pipeline=1"]),
    "20B@64": ("configs/20B.py", 64, ["parallel.zero1=-1", "parallel.tensor=4", "parallel.sequence_parallel=True",
                                      "parallel.pipeline=1"]),
    "70B@256": ("configs/70B.py", 256, ["parallel.zero1=-1", "parallel.tensor=8", "parallel.pipeline=4",
                                        "parallel.sequence_parallel=False"]),
    # Mixtral-8x7B (46.7 B parameters): expert parallel 8, everything FSDP-sharded over the 64 data-parallel ranks,
    # the experts over the 8 left (the estimator's layout for 64 GPUs; tensor parallel would replicate the experts)
    "mixtral@64": ("configs/mixtral_8x7B.py", 64, ["parallel.zero1=-1", "parallel.expert=8", "parallel.tensor=1",
                                                   "parallel.pipeline=1"]),
}


def estimate(config: str, world: int, sets: list[str]) -> dict:
    p = subprocess.run([sys.executable, "tools/estimate.py", "--config", config, "--gpus", str(world), "--device",
                        "cpu", "--json", "--set", *sets], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"tools/estimate.py failed for {config} on {world}: {p.stderr.strip()}")
    return json.loads(p.stdout)


def simulate(config: str, world: int, sets: list[str], run_dir: Path) -> dict:
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "train.py", "--config", config, "--simulate", str(world), "--run-dir",
                        str(run_dir), "--set", *sets, "data.total_steps=2"], cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    (run_dir / "stdout.txt").write_text(p.stdout + p.stderr) if run_dir.exists() else None
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": last, "wall_s": wall}
    return {**json.loads((run_dir / "simulate.json").read_text()), "wall_s": wall}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "simulate_table"))
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = ["| case | layout | parameters held | estimator (cpu) | simulated peak | peak / estimate | wall |",
            "|---|---|---:|---:|---:|---:|---:|"]
    for name in args.cases.split(","):
        config, world, layout = CASES[name]
        sets = COMMON + layout
        est = estimate(config, world, sets)["memory_gib"]["total"]
        print(f"{name}: estimator {est:.2f} GiB; simulating rank 0 ...", flush=True)
        sim = simulate(config, world, sets, out / name.replace("@", "_at_"))
        lay = " ".join(s.split(".", 1)[1] for s in layout)
        if "error" in sim:
            rows.append(f"| {name} | {lay} | - | {est:.2f} GiB | {sim['error']} | - | {sim['wall_s']:.0f} s |")
        else:
            peak = sim["peak_bytes"] / GiB
            rows.append(f"| {name} | {lay} | {sim['parameters_held']:,} | {est:.2f} GiB | {peak:.2f} GiB | "
                        f"{peak / est:.2f} | {sim['wall_s']:.0f} s |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    (out / "table.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
