#!/usr/bin/env python
"""internlm-core as one more peer: `train.py --config configs/bench_cpu.py`, results in the peers' JSON format.

    python bench/internlm.py MODE OUT_DIR [--config configs/bench_cpu.py] [--set KEY=VALUE ...]

MODE: fp32, bf16, compile or bf16_compile (model.dtype and model.compile). The run is the real entry point
in a subprocess; its step times are the `step_time` of metrics.jsonl (end of the previous optimizer step to
the end of this one, data loading, metrics and writers included), steps SKIP+1..STEPS as for the peers.

`other_load` is measured as the peers do it, over the same window (the ends of steps 5 and 35): busy time of
the whole VM from /proc/stat minus the CPU time of the training process (/proc/<pid>/stat, all threads) and of
this watcher, per second of wall time. The watcher notices a new metrics line within POLL_S.
Peak RSS is the training process's ru_maxrss (os.wait4).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.02
SKIP, STEPS = 5, 35
MODES = {"fp32": ("torch.float32", False), "bf16": ("torch.bfloat16", False),
         "compile": ("torch.float32", True), "bf16_compile": ("torch.bfloat16", True)}


def vm_busy_s() -> float:
    f = [int(v) for v in open("/proc/stat").readline().split()[1:8]]
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process, all its threads (fields 14, 15 of /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def snapshot(pid: int) -> tuple[float, float, float]:
    t = os.times()
    return time.perf_counter(), vm_busy_s(), proc_cpu_s(pid) + t.user + t.system


def n_params_and_flops(config: str, overrides: list[str]) -> tuple[int, int, int]:
    from internlm_core.config import load_config
    from internlm_core.model import analytic_parameter_count, flops_per_token, model_args_from_config
    cfg = load_config(config, overrides)
    args = model_args_from_config(cfg, "cpu", )
    tokens = cfg.data.seq_len * cfg.data.micro_bsz * cfg.data.micro_num
    return analytic_parameter_count(args), flops_per_token(args, cfg.data.seq_len), tokens


def run(mode: str, out_dir: str | Path, config: str = "configs/bench_cpu.py", overrides: list[str] = (),
        python: str = sys.executable, name: str = "internlm_core", steps: int = STEPS, skip: int = SKIP) -> dict:
    """Train `steps` steps in `mode`; step times of steps skip+1..steps; writes OUT_DIR/<name>.json."""
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = out_dir / f"{name}_run"
    shutil.rmtree(run_dir, ignore_errors=True)
    dtype, compiled = MODES[mode]
    sets = [f"model.dtype={dtype}", f"model.compile={compiled}", f"data.total_steps={steps}", *overrides]
    cmd = [python, str(ROOT / "train.py"), "--config", config, "--run-dir", str(run_dir), "--set", *sets]
    metrics = run_dir / "metrics.jsonl"
    with open(out_dir / f"{name}.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        snaps, seen, status, rusage = {}, 0, None, None
        while status is None:
            pid, st, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                status, rusage = st, ru
                break
            if metrics.exists() and len(snaps) < 2:
                with open(metrics) as fh:
                    n = sum(1 for line in fh if '"kind": "train"' in line)
                for k in (skip, steps):
                    if seen < k <= n:
                        try:
                            snaps[k] = snapshot(p.pid)
                        except OSError:  # exited between the two reads
                            pass
                seen = n
            time.sleep(POLL_S)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        tail = (out_dir / f"{name}.log").read_text().splitlines()[-30:]
        raise RuntimeError(f"{name} {mode}: train.py exited with {p.returncode}:\n" + "\n".join(tail))
    records = [json.loads(line) for line in open(metrics)]
    train = {r["step"]: r for r in records if r.get("kind") == "train"}
    if sorted(train) != list(range(1, steps + 1)):
        raise RuntimeError(f"{name} {mode}: expected steps 1..{steps} in {metrics}, got {sorted(train)}")
    dts = [train[s]["step_time"] for s in range(skip + 1, steps + 1)]
    losses = [train[s]["loss"] for s in range(1, steps + 1)]
    n_params, fpt, tokens = n_params_and_flops(str(ROOT / config), sets)
    med = statistics.median(dts)
    other = None
    if skip in snaps and steps in snaps:
        a, b = snaps[skip], snaps[steps]
        other = ((b[1] - a[1]) - (b[2] - a[2])) / (b[0] - a[0])
    res = dict(peer=name, mode=mode, n_params=n_params, flops_per_token=fpt, tokens_per_step=tokens,
               timed_steps=f"{skip + 1}..{steps}", step_ms_median=1e3 * med, tok_s_median=tokens / med,
               tok_s_mean=tokens * len(dts) / sum(dts), step_ms=[1e3 * d for d in dts],
               peak_rss_mb=rusage.ru_maxrss / 1024,
               loss_every5={s: statistics.fmean(losses[s - 5:s]) for s in range(5, steps + 1, 5)},
               final_loss=statistics.fmean(losses[steps - 5:steps]), last_loss=losses[-1], losses=losses,
               other_load=other, run_dir=str(run_dir), command=cmd,
               step_parts_ms={k[5:]: 1e3 * statistics.median(train[s].get(k, 0.0) for s in range(skip + 1, steps + 1))
                              for k in train[steps] if k.startswith("time/")})
    with open(out_dir / f"{name}.json", "w") as fh:
        json.dump(res, fh, indent=1)
    print(f"{name}: {res['tok_s_median']:.0f} tok/s, {med * 1e3:.1f} ms/step, final loss {res['final_loss']:.3f}, "
          f"peak RSS {res['peak_rss_mb']:.0f} MB")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=sorted(MODES))
    p.add_argument("out_dir")
    p.add_argument("--config", default="configs/bench_cpu.py")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    p.add_argument("--name", default="internlm_core")
    a = p.parse_args(argv)
    run(a.mode, a.out_dir, a.config, a.set, name=a.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
