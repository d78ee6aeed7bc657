"""Settings every test process shares (pytest's own processes and what they fork or start)."""

import os

# a fixed MFU denominator instead of ~1 s of matmuls in every process that builds a trainer (utils/peak.py);
# tests/unit/test_loss_metrics.py measures the real one
os.environ.setdefault("INTERNLM_CORE_PEAK_TFLOPS", "0.05")
# test files run on 2 workers on 2 cores: one thread each (runs that want more set OMP_NUM_THREADS themselves);
# idle OpenMP threads sleep instead of spinning on a core another process needs
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
