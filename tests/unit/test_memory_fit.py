"""The memory check before materializing (internlm_core/estimate/fit.py): verdicts against the estimator's error,
the one-line refusal, the layouts it names, and the keys that steer it."""

import logging

import psutil
import pytest
import torch

from internlm_core.config import load_config
from internlm_core.errors import ConfigError
from internlm_core.estimate import GiB
from internlm_core.estimate.fit import (ESTIMATE_MARGIN, RankMemory, check_memory, fitting_layouts, free_memory,
                                        memory_need)
from internlm_core.utils.cpu_features import CpuFeatures, pinned

CPU = torch.device("cpu")
# the 7B figures below are the unfused head's (model.fused_head_loss "auto" may fuse it: tests/unit/test_fused_head.py)
UNFUSED = "model.fused_head_loss=False"


def tiny(*sets):
    return load_config("configs/tiny.py", list(sets), world_size=1)


def test_verdicts_follow_the_estimator_margin():
    need = 10 * GiB
    assert RankMemory(0, "h", need, need * (1 + ESTIMATE_MARGIN), "x").verdict == "fits"
    assert RankMemory(0, "h", need, need, "x").verdict == "near"
    assert RankMemory(0, "h", need, need * (1 - ESTIMATE_MARGIN) * 1.001, "x").verdict == "near"
    assert RankMemory(0, "h", need, need * (1 - ESTIMATE_MARGIN) * 0.999, "x").verdict == "over"


def test_refusal_names_both_numbers_and_the_layouts_that_fit():
    """7B on 8 GPUs (the estimate is 36.3 GiB each under the dtype policy: bf16 activations under FSDP): with 30 GiB free each refused in one line naming the nearest
    layout; with 36 GiB (within the error) a warning naming several, one per kind."""
    cfg = load_config("configs/7B.py", ["memory_limit_gib=30", UNFUSED], world_size=8)
    need = memory_need(cfg, 8, "cuda")
    assert need == pytest.approx(36.34 * GiB, rel=1e-3)
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, 8, 0, torch.device("cuda", 0), distributed=False)
    assert str(e.value) == (
        "memory: the estimator puts this process at 36.3 GiB per device (cuda, +/-15%) but 30.0 GiB is free "
        "(memory_limit_gib=30); layouts that fit: model.checkpoint=True (19.9 GiB); parallel.tensor=4 (23.3 GiB); "
        "64 devices with parallel.zero1=-1 (24.4 GiB each); train.py --force or "
        'memory_check="warn" runs anyway, memory_check="off" skips this check, memory_limit_gib sets the free figure')
    assert fitting_layouts(cfg, 8, "cuda", 36 * GiB) == [
        "model.checkpoint=True (19.9 GiB)", "data.micro_bsz=1 data.micro_num=8 (26.5 GiB)",
        "parallel.tensor=2 (29.0 GiB)", "16 devices with parallel.zero1=-1 (29.5 GiB each)"]


@pytest.mark.parametrize("cpu,each", [(CpuFeatures.NATIVE, 13.1), (CpuFeatures.EMULATED, 14.0)],
                         ids=["native-bf16-gemm", "no-native-bf16-gemm"])
def test_layouts_that_fit_are_really_under_the_free_memory(cpu, each):
    """The figures follow the CPU's features, pinned: without native bf16 GEMM the linear layers' fp32 GEMMs keep
    fp32 copies of their operands for the backward (0.9 GiB more each here)."""
    with pinned(cpu):
        _layouts_under_the_free_memory(each)


def _layouts_under_the_free_memory(each: float) -> None:
    cfg = load_config("configs/7B.py", [UNFUSED], world_size=1)
    free = 22 * GiB
    layouts = fitting_layouts(cfg, 1, "cpu", free)
    assert layouts == ["16 devices with parallel.zero1=-1 model.checkpoint=True data.micro_bsz=1 data.micro_num=8 "
                       f"({each} GiB each)"]
    big = load_config("configs/7B.py", [UNFUSED, "parallel.zero1=-1", "model.checkpoint=True", "data.micro_bsz=1",
                                        "data.micro_num=8"], world_size=16)
    assert memory_need(big, 16, "cpu") * (1 + ESTIMATE_MARGIN) <= free
    half = load_config("configs/7B.py", [UNFUSED, "parallel.zero1=-1", "model.checkpoint=True", "data.micro_bsz=1",
                                         "data.micro_num=8"], world_size=8)
    assert memory_need(half, 8, "cpu") * (1 + ESTIMATE_MARGIN) > free  # 16 is the nearest


def test_near_the_limit_warns_and_force_runs(caplog):
    cfg = tiny()
    need = memory_need(cfg, 1, "cpu")
    cfg.memory_limit_gib = need / GiB  # free == need: inside the error band
    with caplog.at_level(logging.WARNING, logger="internlm_core"):
        worst = check_memory(cfg, 1, 0, CPU, distributed=False)
    assert worst.verdict == "near" and worst.free == pytest.approx(need)
    assert "within the estimator's error: it may run out of memory" in caplog.text
    cfg.memory_limit_gib = need / GiB / 4  # over: refused, unless memory_check="warn" (train.py --force)
    with pytest.raises(ConfigError, match="is free \\(memory_limit_gib="):
        check_memory(cfg, 1, 0, CPU, distributed=False)
    cfg.memory_check = "warn"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="internlm_core"):
        assert check_memory(cfg, 1, 0, CPU, distributed=False).verdict == "over"
    assert 'running anyway (memory_check="warn")' in caplog.text
    cfg.memory_check = "off"
    assert check_memory(cfg, 1, 0, CPU, distributed=False) is None


def test_a_tiny_run_fits_this_machine():
    worst = check_memory(tiny(), 1, 0, CPU, distributed=False)
    assert worst.verdict == "fits" and worst.source == "host RAM available"
    assert worst.free <= psutil.virtual_memory().total


@pytest.mark.parametrize("key,value,expected", [
    ("memory_check", "maybe", "memory_check: expected one of refuse, warn, off, got 'maybe'"),
    ("memory_limit_gib", -1.0, "memory_limit_gib: expected a positive number of GiB or None, got -1.0"),
])
def test_bad_keys(key, value, expected):
    cfg = tiny()
    setattr(cfg, key, value)
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, 1, 0, CPU, distributed=False)
    assert str(e.value) == expected


def test_free_memory_sources():
    assert free_memory(CPU, 2.5) == (2.5 * GiB, "memory_limit_gib=2.5")
    free, where = free_memory(CPU)
    assert 0 < free <= psutil.virtual_memory().total and where in (
        "host RAM available", "the memory cgroup's limit less its usage")
