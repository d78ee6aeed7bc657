"""Settings every test process shares (pytest's own processes and what they fork or start)."""

import os

# a fixed MFU denominator instead of ~1 s of matmuls in every process that builds a trainer (utils/peak.py);
# tests/unit/test_loss_metrics.py measures the real one
os.environ.setdefault("INTERNLM_CORE_PEAK_TFLOPS", "0.05")
