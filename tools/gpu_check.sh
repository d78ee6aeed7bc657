#!/usr/bin/env bash
# The one GPU check: every GPU path once, in a few minutes on an H100/H200, and one table at the end.
#
#   bash tools/gpu_check.sh [out-dir]       PY=python3 by default; APEX=1 also runs apex's FusedAdam;
#                                           SET="model.num_layers=16 ..." extra overrides of the training runs
#
# 1. bench/gpu_paths.py: which accelerators import AND run; the kernels numerics.select_kernels picks for bf16 and
#    fp32; flash-attn's varlen kernel vs SDPA (dense document mask) vs the blocked kernel on one packed batch;
#    SDPA's grouped-query + mask path; fp32 inputs through the flash path; every cross entropy kernel in bf16 and
#    fp16 under a 2**16 loss scale against fp32; host synchronizations in one packed micro-batch; apex if asked.
# 2. configs/bench_gpu.py (1.1B Llama, bf16, packed documents) for 30 steps on one GPU: tokens/s and MFU (against
#    the dense bf16 peak of the GPU's name, utils/peak.py) and the peak memory (memory_report.json).
# 3. With two GPUs visible: the same model under FSDP on 2 GPUs (4 micro-batches, reduce-scatter each) for 10 steps.
# Each part has its own time limit; a part that fails shows as FAIL in the table and the others still run.
# Exit status: 0 when no row failed. Outputs stay in out-dir (default $OUT/gpu_check or build/gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUTDIR=${1:-${OUT:-build}/gpu_check}
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
ADAM=torch
PATHS_ARGS=()
if [ "${APEX:-0}" = "1" ]; then ADAM=apex; PATHS_ARGS+=(--apex); fi
if [ "$NGPU" -lt 1 ]; then
    echo "no CUDA device: the kernel checks run small, on the CPU; the training rows are skipped"
    PATHS_ARGS+=(--quick)
fi

timeout 240 "$PY" bench/gpu_paths.py --json "$OUTDIR/paths.json" "${PATHS_ARGS[@]}" 2>&1 | tee "$OUTDIR/paths.log"

if [ "$NGPU" -ge 1 ]; then
    # shellcheck disable=SC2086
    timeout 300 "$PY" train.py --config configs/bench_gpu.py --run-dir "$OUTDIR/train1" --set data.total_steps=30 \
        adam.fused=$ADAM monitor.memory_report=True ${SET:-} > "$OUTDIR/train1.log" 2>&1 \
        || echo "1-GPU training failed: tail $OUTDIR/train1.log"
fi
if [ "$NGPU" -ge 2 ]; then
    # shellcheck disable=SC2086
    timeout 300 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 train.py --config configs/bench_gpu.py \
        --run-dir "$OUTDIR/fsdp2" --set data.total_steps=10 data.micro_bsz=2 data.micro_num=4 adam.fused=torch \
        monitor.memory_report=True ${SET:-} > "$OUTDIR/fsdp2.log" 2>&1 \
        || echo "2-GPU FSDP training failed: tail $OUTDIR/fsdp2.log"
fi
"$PY" bench/gpu_paths.py --table "$OUTDIR" | tee "$OUTDIR/table.md"
