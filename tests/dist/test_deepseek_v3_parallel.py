"""DEEPSEEK_V3 under tensor (with sequence), expert and pipeline parallel on two gloo ranks, one launch: each
layout trains as one process over 10 fp32 AdamW steps, per-step losses within 1e-5 (tests/dist/deepseek_v3_driver.py
says how each layout is run and compared)."""

import pytest

from tests.helpers.launch import ROOT, env

pytestmark = pytest.mark.slow


def test_tp2_ep2_pp2_train_as_one_process():
    from tests.helpers import warm
    p = warm.run(str(ROOT / "tests/dist/deepseek_v3_driver.py"), [], env(), ROOT, timeout=240, nproc=2)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert p.stdout.count(": ok") == 2, p.stdout
