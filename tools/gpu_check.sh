#!/usr/bin/env bash
# One short GPU check (well under 5 minutes on an H100/H200): train configs/bench_gpu.py (~1.1B, bf16) for
# 30 steps on one GPU and print tokens/s per GPU and MFU against 989 TFLOP/s (median of steps 6..30).
# Usage: bash tools/gpu_check.sh [run-dir]      PY=python3 by default; COMPILE=1 also compiles the blocks;
# extra --set overrides in SET="model.num_layers=16 ...".
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RUN=${1:-${OUT:-build}/gpu_check}
rm -rf "$RUN"
"$PY" - <<'PY'
import importlib.util, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device: "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA DEVICE'}; "
      f"flash-attn {'importable' if importlib.util.find_spec('flash_attn') else 'not installed (SDPA)'}")
PY
SETS="data.total_steps=30 ${SET:-}"
if [ "${COMPILE:-0}" = "1" ]; then SETS="$SETS model.compile=True"; fi
# shellcheck disable=SC2086
timeout 280 "$PY" train.py --config configs/bench_gpu.py --run-dir "$RUN" --set $SETS 2>&1 | tail -n 8
"$PY" - "$RUN/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"kind": "train"' in l]
timed = [r for r in rows if r["step"] > 5]
tgs = statistics.median(r["tgs"] for r in timed)
fpt = timed[0]["tflops"] * 1e12 / timed[0]["tgs"]       # model FLOPs per token, as the trainer counts them
print(f"steps {len(rows)}, final loss {rows[-1]['loss']:.3f}")
print(f"tokens/s per GPU (median of steps 6..{rows[-1]['step']}): {tgs:,.0f}")
print(f"MFU against 989 TFLOP/s (bf16 dense): {tgs * fpt / 989e12:.1%}  ({tgs * fpt / 1e12:.0f} TFLOP/s achieved)")
PY
