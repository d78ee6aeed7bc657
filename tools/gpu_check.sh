#!/usr/bin/env bash
# The GPU check: one short run on one GPU that either proves every row it promises or says which it did not.
#
#   bash tools/gpu_check.sh [out-dir]            run it (PY=python3 by default: the machine's own Python and torch)
#   bash tools/gpu_check.sh --dry-run [out-dir]  list every row, run none (exit status 2: unproven)
#
# Nothing is installed: the check runs with the torch that is there (supported: 2.11-2.15, see requirements.txt) and
# the packages of requirements.txt. The rows (bench/gpu_rows.py, in this order): flash-attn's attention and cross
# entropy and apex's FusedAdam first, only where importable (absent elsewhere, not promised); the device and torch
# version; every torch name the code uses (tools/torch_api_names.py) looked up in that torch; the counter-based
# init on the GPU against the CPU; a one-rank NCCL group running a non-last pipeline
# stage's per-step collectives (and refusing a host tensor); real trainer steps in bf16, fp16 and fp32 with
# micro_num 2 under torch.cuda.set_sync_debug_mode("warn") (no host sync inside the micro-batch loop); one async
# save and resume on CUDA; the CUDA allocator's peak (allocated, reserved) beside estimate(device="cuda");
# configs/bench_gpu.py's tokens/s and MFU, eager and compiled, beside the estimator's predicted ones
# (bench/gpu_rows_speed.py); `train.py --simulate 8 --simulate-device cuda` for rank 0 of 7B; the device peak and
# step time with model.offload_activations against without (bench/gpu_rows_offload.py); the kernel choice and the
# loss kernels; then
# (bench/gpu_rows_numerics.py) the context-parallel attention fed fp32 q/k and a bf16 v, one MoE micro-batch through
# the grouped GEMM under set_sync_debug_mode (its host syncs counted and located), the norms' output dtype under CUDA
# autocast, and the torch API scan test (tests/unit/test_torch_api*.py, pytest -q); the varlen kernel against its CPU
# contract; model.fp8 tensorwise against bf16, tokens/s beside the estimator's predicted ratio (bench/gpu_rows_fp8.py);
# the fused head against the unfused one at vocabulary 152K: peak, host syncs, gradients (bench/gpu_rows_fused_head.py).
# A 16-bit kernel is compared with an fp32 reference tensor by tensor: each of out, dq, dk, dv may be off by 2% of
# its own max or 4x a 16-bit reference implementation's own error, whichever is larger (dv is ~5x the output: one
# tolerance from the output's max failed two correct kernels); a wrong mask is off by 5-50x more.
#
# Each row is printed and appended to out-dir/results.jsonl as it finishes; the whole is capped at CAP_S seconds
# (default 420: 7 minutes). A row that cannot finish in the time left does not start, and one the cap cut off
# never wrote: both are UNPROVEN, as is every row on a machine without CUDA. The table at the end
# (out-dir/table.md) lists every row. Exit status: 0 only when every promised row ran and passed, 1 when one
# failed, 2 when none failed but one did not run. A skipped row is never a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DRY=()
if [ "${1:-}" = "--dry-run" ]; then DRY=(--dry-run); shift; fi
OUTDIR=${1:-${OUT:-build}/gpu_check}
CAP_S=${CAP_S:-420}
rm -rf "$OUTDIR"
mkdir -p "$OUTDIR"

# the rows' own budget leaves 20 s of the cap for the interpreter's start and the table
timeout --kill-after=10 "$CAP_S" "$PY" bench/gpu_paths.py --out "$OUTDIR" --budget-s $((CAP_S - 20)) "${DRY[@]}"
run_status=$?
if [ "$run_status" -eq 124 ] || [ "$run_status" -eq 137 ]; then
    echo "time cap of ${CAP_S} s reached: the rows not written above did not run (unproven)"
fi
"$PY" bench/gpu_paths.py --table "$OUTDIR" | tee "$OUTDIR/table.md"
table_status=${PIPESTATUS[0]}
if [ "$table_status" -eq 0 ] && [ "$run_status" -ne 0 ]; then
    table_status=2  # the run itself did not end cleanly: nothing it did not write is proven
fi
exit "$table_status"
