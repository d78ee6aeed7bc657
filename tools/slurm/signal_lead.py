"""How many seconds before the time limit SLURM must signal a job so that it still saves a checkpoint.

    python tools/slurm/signal_lead.py RUN_DIR        # a run folder of train.py (rank0.log, metrics.jsonl)

On SIGUSR1 the trainer finishes the step it is in, saves, and exits; the save must also be complete (staged,
written and uploaded) before SLURM kills the job. This reads what an earlier run of the same job measured:
the slowest step (`step_time` in metrics.jsonl) and the slowest complete checkpoint (the log's "checkpoint ...
complete: step N, X MB in T s"), adds SLURM's event resolution (a signal may come up to 60 s off) and a
safety factor, and prints the `#SBATCH --signal=USR1@N` line to use.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

_SAVE = re.compile(r"checkpoint \S+ complete: step (\d+), ([\d.]+) MB in ([\d.]+) s")
SLURM_RESOLUTION_S = 60.0


def measured(run_dir: Path) -> tuple[float, float, int]:
    """(slowest step seconds, slowest complete checkpoint seconds, checkpoints seen) of a run folder."""
    step = 0.0
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("kind") == "train" and "step_time" in rec:
                step = max(step, float(rec["step_time"]))
    saves = []
    log = run_dir / "rank0.log"
    if log.exists():
        saves = [float(m.group(3)) for m in _SAVE.finditer(log.read_text(errors="replace"))]
    return step, max(saves, default=0.0), len(saves)


def lead_seconds(step_s: float, save_s: float, safety: float = 1.5) -> int:
    """Seconds of lead: (one step + one whole save) x safety + SLURM's resolution, rounded up to 30 s."""
    return int(math.ceil((safety * (step_s + save_s) + SLURM_RESOLUTION_S) / 30.0) * 30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--safety", type=float, default=1.5, help="factor on step + save time (default 1.5)")
    a = p.parse_args(argv)
    step, save, n = measured(a.run_dir)
    if n == 0:
        print(f"{a.run_dir}: no complete checkpoint in rank0.log yet; measure one (ckpt.checkpoint_every) first",
              file=sys.stderr)
        return 1
    lead = lead_seconds(step, save, a.safety)
    print(f"slowest step {step:.1f} s, slowest checkpoint {save:.1f} s ({n} saves): "
          f"#SBATCH --signal=USR1@{lead}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
