#!/usr/bin/env python
"""Where a training step of configs/bench_cpu.py spends its time: torch.profiler over a few steps of the real
Trainer (built as train.py builds it), top operators by self CPU time.

    python bench/profile_step.py [--set model.dtype=torch.bfloat16 ...] [--steps 3] [--rows 30]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "bench_cpu.py"))
    p.add_argument("--set", nargs="*", default=[])
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=30)
    p.add_argument("--sort", default="self_cpu_time_total")
    a = p.parse_args(argv)
    import torch
    from internlm_core.config import load_config
    from internlm_core.distributed import init_distributed
    from internlm_core.trainer.build import build_trainer
    from internlm_core.utils.memory import keep_freed_cpu_memory

    launch = init_distributed(None)
    cfg = load_config(a.config, a.set + [f"data.total_steps={a.warmup + a.steps}"], world_size=1)
    with tempfile.TemporaryDirectory() as d:
        tr = build_trainer(cfg, launch, Path(d))
        it = iter(tr.train_loader)
        keep_freed_cpu_memory()  # as build_trainer does: otherwise page faults of fresh blocks show up as copies
        t_end = time.perf_counter()
        for i in range(a.warmup):
            tr.train_step(next(it), t_end)
            t_end = tr._step_end
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            times = []
            for i in range(a.steps):
                t0 = time.perf_counter()
                m = tr.train_step(next(it), t_end)
                tr.writer.write(i, m)
                t_end = tr._step_end
                times.append(time.perf_counter() - t0)
        tr.writer.close()
    print(f"step times under the profiler: {[round(t * 1e3) for t in times]} ms")
    print(prof.key_averages().table(sort_by=a.sort, row_limit=a.rows, max_name_column_width=50))
    return 0


if __name__ == "__main__":
    sys.exit(main())
