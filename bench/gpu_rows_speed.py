"""The GPU check's speed rows (bench/gpu_rows.py lists them in ROWS): configs/bench_gpu.py (1.1B, bf16) trained on
one GPU, eager and under model.compile, its measured tokens/s per GPU and MFU (the trainer's metrics.jsonl) printed
beside the estimator's prediction for this GPU (internlm_core/estimate/speed.py, with the kernels the run chose).

A row passes when the measured tokens/s is within 0.5x-1.5x of the prediction (the prediction's efficiencies are
assumptions: a row outside that range says which of them to correct). The issue's target, at least 45% bf16 MFU
on one H200, is printed as met or not; it does not decide the row.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TARGET_MFU = 0.45
STEPS = 30


def _gpu_key(device_name: str) -> str:
    """The estimator's GPU table name of this device (h100, h200, a100), or '' when it has none."""
    name = device_name.upper()
    for key in ("H200", "H100", "A100"):
        if key in name and "PCIE" not in name and "NVL" not in name:
            return key.lower()
    return ""


def measured(run_dir: Path) -> tuple[float, float]:
    """Median tokens/s per GPU and MFU of the logged train steps after the first 10 (compilation, warm-up)."""
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "train" and r.get("step", 0) > 10 and r.get("tgs")]
    if not rows:
        raise RuntimeError(f"{run_dir / 'metrics.jsonl'}: no train step after step 10 logged tgs")
    return statistics.median(r["tgs"] for r in rows), statistics.median(r.get("mfu") or 0.0 for r in rows)


def speed_row(out: Path, compile_model: bool) -> tuple[bool, str, str]:
    """Train configs/bench_gpu.py STEPS steps; measured beside predicted."""
    from gpu_rows import _trainer
    from internlm_core.config import load_config
    from internlm_core.estimate import estimate
    from internlm_core.estimate.gpus import gpu_spec
    from internlm_core.estimate.speed import predict

    cfg = load_config(str(ROOT / "configs/bench_gpu.py"), [f"data.total_steps={STEPS}", "monitor.log_every=1",
                                                            "monitor.tensorboard=False",
                                                            f"model.compile={compile_model}"])
    run_dir = out / ("speed_compiled" if compile_model else "speed_eager")
    trainer = _trainer(cfg, run_dir)
    trainer.train()
    tgs, mfu = measured(run_dir)
    key = _gpu_key(torch.cuda.get_device_name(0))
    target = f"target {TARGET_MFU:.0%} MFU {'met' if mfu >= TARGET_MFU else 'NOT met'}"
    if not key:
        return True, f"measured {tgs:,.0f} tokens/s/GPU, MFU {mfu:.1%}; {target}", \
            f"no prediction: {torch.cuda.get_device_name(0)} is not in estimate/gpus.py"
    e = estimate(cfg, 1, device="cuda", attention=trainer.kernels.attention)
    p = predict(e, gpu_spec(key))
    ratio = tgs / p.tokens_per_gpu_per_second
    return 0.5 <= ratio <= 1.5, (f"measured {tgs:,.0f} tokens/s/GPU, MFU {mfu:.1%}; predicted "
                                 f"{p.tokens_per_gpu_per_second:,.0f}, MFU {p.mfu:.1%} (measured / predicted "
                                 f"{ratio:.2f}); {target}"), \
        f"{key}, attention {trainer.kernels.attention}; predicted bound by: {p.bound_by()}"


def row_speed_eager(out: Path):
    return speed_row(out, compile_model=False)


def row_speed_compiled(out: Path):
    return speed_row(out, compile_model=True)
