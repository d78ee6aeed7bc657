"""The new families' block options under tensor parallel, on two gloo ranks: QWEN3 and QWEN3_MoE (q/k norms over
each rank's heads, head_dim apart from width / heads, a sliding window shorter than the sequence), with and without
sequence parallel, give the unsharded model's logits and gradients (tests/dist/qk_norm_tp_driver.py)."""

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow


def test_qk_norm_and_window_under_tensor_parallel_equal_one_process():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/qk_norm_tp_driver.py"), [], env(), ROOT, timeout=180, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 2, p.stdout
