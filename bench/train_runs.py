"""One short training run of train.py for a benchmark of bench/: one process, or `nproc` under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_records(run_dir: Path, nproc: int, config: str, sets: list[str], steps: int) -> list[dict]:
    """Train `config` with overrides `sets` for `steps` steps (one metrics line at the end) into `run_dir`; the
    run's per-step training records (metrics.jsonl). SystemExit with the run's stderr when it fails."""
    cmd = [sys.executable, "train.py"] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                           "--standalone", f"--nproc_per_node={nproc}", "train.py"]
    cmd += ["--config", config, "--run-dir", str(run_dir), "--set", *sets, f"data.total_steps={steps}",
            f"lr_scheduler.total_steps={steps}", f"monitor.log_every={steps}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{run_dir.name} failed:\n{p.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "train"]


def write_table(out: Path, rows: list[str]) -> None:
    """Print the markdown table `rows` and keep it as out/table.md."""
    table = "\n".join(rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    print(table)
