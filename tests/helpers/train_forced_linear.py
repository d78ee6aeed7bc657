"""tests/helpers/train_live_memory.py with the CPU's 16-bit GEMM decision forced, so that one machine measures
both linear paths of a bf16 run (numerics.select_linear; the estimator's `linear`):

    python tests/helpers/train_forced_linear.py native|fp32_gemm TRAIN_ARGS...

native: bf16 linear layers under autocast (F.linear, autocast's cached weight casts; on a CPU without
avx512_bf16 / AMX oneDNN emulates the bf16 GEMMs, correctly but slowly); fp32_gemm: model/layers.py's
HalfLinearFp32Gemm (fp32 GEMMs rounded once), what a CPU without native bf16 GEMM runs.
"""

import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from internlm_core.utils import cpu_features  # noqa: E402

mode, sys.argv = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
if mode not in ("native", "fp32_gemm"):
    sys.exit(f"train_forced_linear.py: expected native or fp32_gemm, got {mode!r}")
machine = cpu_features.detect()
others = tuple(d for d in machine.native_half_gemm if d != torch.bfloat16)
# the CPU's features as kernels, numerics and the estimator read them
native = others + ((torch.bfloat16,) if mode == "native" else ())
cpu_features.pin(cpu_features.CpuFeatures(native, machine.onednn_linear))
runpy.run_path(str(Path(__file__).with_name("train_live_memory.py")), run_name="__main__")
