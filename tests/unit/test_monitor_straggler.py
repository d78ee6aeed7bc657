"""Straggler check in one process (the 2-rank version is in tests/dist/test_monitor_dist.py)."""

import socket

import pytest
import torch

from internlm_core.monitor.straggler import (FRAGMENTED_BYTES, StragglerMonitor, build_straggler_monitor,
                                             cache_is_fragmented, device_benchmark, diagnose_stragglers)

GiB = 1 << 30


def test_single_process_reports_itself():
    r = diagnose_stragglers(0.5, 1.1, step=10)
    assert (r.ranks, r.hosts, r.times, r.stragglers) == ([0], [socket.gethostname()], {"step_time": [0.5]}, [])
    assert r.format() == "step 10: no straggler among 1 rank(s) (step_time mean 0.5000 s max 0.5000 s)"


def test_monitor_sums_timer_keys_and_falls_back_to_wall_time():
    m = StragglerMonitor(interval=3, time_keys=("fwd", "bwd"), bench=False)
    m.on_train_start(None)
    for step in range(1, 4):
        m.on_step_end(None, {"step": step, "fwd": 0.1, "bwd": 0.2})
    assert m.last_report.times == {"fwd": [pytest.approx(0.3)], "bwd": [pytest.approx(0.6)]}
    wall = StragglerMonitor(interval=2, bench=False)  # default keys time/...: absent from these records
    wall.on_train_start(None)
    wall.on_step_end(None, {"step": 1})
    assert wall.last_report is None
    wall.on_step_end(None, {"step": 2})
    assert list(wall.last_report.times) == ["step_time"] and wall.last_report.step == 2


def test_bench_and_build():
    assert device_benchmark(size=64, iters=2) > 0
    class Data:
        empty_cache_and_diag_interval = 0
        diag_outlier_ratio = 1.3
    assert build_straggler_monitor(Data()) is None
    Data.empty_cache_and_diag_interval = 50
    m = build_straggler_monitor(Data(), rank=1)
    assert (m.interval, m.outlier_ratio, m.rank) == (50, 1.3, 1)


@pytest.mark.parametrize("reserved, allocated, fragmented", [
    (60 * GiB, 59 * GiB, False),   # the steady state: the cache is what the next step allocates again
    (60 * GiB, 57.9 * GiB, False),  # 2.1 GiB idle but 3.5% of the cache: a big model's normal slack
    (10 * GiB, 7.5 * GiB, True),   # 2.5 GiB idle, 25% of the cache
    (10 * GiB, 8.5 * GiB, False),  # 1.5 GiB idle: under 2 GiB
    (4 * GiB, 0, True),            # everything idle
    (1 * GiB, 0, False),           # a small cache: nothing worth freeing
])
def test_the_cache_is_fragmented_only_over_2_gib_and_a_fifth_of_itself(reserved, allocated, fragmented):
    assert cache_is_fragmented(int(reserved), int(allocated)) is fragmented


def test_the_check_empties_the_cuda_cache_only_where_fragmentation_is_shown(monkeypatch):
    """Every check on CUDA emptied the cache (InternLM's habit): a free and a new allocation of every cached segment
    on every rank each `interval` steps. Now only when the memory stats show fragmentation."""
    stats = {"reserved": 40 * GiB, "allocated": 39 * GiB}
    emptied = []
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: stats["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: stats["allocated"])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(stats["reserved"] - stats["allocated"]))
    m = StragglerMonitor(interval=2, device=torch.device("cuda", 0), bench=False)
    m.on_train_start(None)
    for step in (1, 2):
        m.on_step_end(None, {"step": step})
    assert emptied == []  # 1 GiB idle in a 40 GiB cache: kept
    stats["allocated"] = 30 * GiB
    for step in (3, 4):
        m.on_step_end(None, {"step": step})
    assert emptied == [10 * GiB] and 10 * GiB > FRAGMENTED_BYTES  # 10 GiB idle, a quarter of the cache: emptied
    m.on_step_end(None, {"step": 5})
    assert emptied == [10 * GiB]  # not a check step
